"""Draft heads trained on a target (EAGLE, Medusa): their runtimes and their files."""
