"""The CRC-32 every checksum in zerompi uses: zlib-ng's when installed (``pip install zlib-ng``,
the ``nvme`` extra), else zlib's. Both compute the same CRC-32 (the same values, seeds included);
zlib-ng's uses carry-less multiplication, about ten times faster, and frees the GIL as zlib does
for large buffers, so checksums on I/O threads run beside Python."""
from __future__ import annotations

try:
    from zlib_ng.zlib_ng import crc32
except ImportError:  # plain zlib: same values, slower
    from zlib import crc32

__all__ = ["crc32"]
