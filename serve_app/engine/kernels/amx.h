// What the AMX-INT8 paths share: the tile configuration (palette 1) of one thread.
//
// Linux grants a process the tile state on request (``isa.cpp`` asks once, and only then offers the
// amx path); each thread that runs tile instructions loads a configuration first and releases its
// tiles when done, so the kernel never leaves tile state for the OS to save.
#pragma once

#include <cstdint>

#include "common.h"

namespace specserve {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of each tile
  uint8_t rows[16] = {};

  void set(int tile, int tile_rows, int bytes_per_row) {
    rows[tile] = static_cast<uint8_t>(tile_rows);
    colsb[tile] = static_cast<uint16_t>(bytes_per_row);
  }
};

constexpr int64_t kAmxChunk = 16;  // activation rows per A tile

// The layout both products use, for ``rows`` activation rows (at most 16 per chunk): tiles 0, 1 the
// A tiles (rows x 32 activations: one block), 2, 3 the B tiles (8 x 64 bytes: 16 outputs x 4 inputs
// per row, one block), 4 .. 7 the C tiles (rows x 16 int32 sums).
inline TileConfig amx_config(int64_t rows) {
  const int chunk = static_cast<int>(rows < kAmxChunk ? rows : kAmxChunk);
  TileConfig config;
  for (int t = 0; t < 2; ++t) {
    config.set(t, chunk, 32);
    config.set(2 + t, 8, 64);
  }
  for (int t = 4; t < 8; ++t) config.set(t, chunk, 64);
  return config;
}

#if SPECSERVE_AVX512
// Tiles for the calling thread: loaded on construction, released on destruction.
class TileScope {
 public:
  SPECSERVE_AMX_FN explicit TileScope(const TileConfig& config) { _tile_loadconfig(&config); }
  SPECSERVE_AMX_FN ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};
#endif

}  // namespace specserve
