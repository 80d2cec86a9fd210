"""Code shared by several stages (I/O, params, hashing). Stage logic lives in stages/<stage>.py."""
