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
