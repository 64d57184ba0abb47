"""portagrpo-emu: an emulated accelerator backend, installed through the `portagrpo.backends` entry point."""
