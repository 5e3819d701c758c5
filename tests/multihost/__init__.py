"""The multi-host test bed's tests (marker ``multihost``): docs/multihost.md."""
