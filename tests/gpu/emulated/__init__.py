"""GPU tier tests that run on the CPU emulator too (tests/emu) when there is no GPU."""
