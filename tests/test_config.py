"""Byte sizes as the flags and EngineConfig take them (--kv-cache-memory, --swap-space)."""
import pytest

from nano.errors import NanoError
from run import parse_bytes


@pytest.mark.parametrize("text, expected", [
    ("2GB", 2 * 10**9), ("2gb", 2 * 10**9), ("512MiB", 512 * 2**20), ("1.5GiB", 3 * 2**29),
    ("4KB", 4000), ("4KiB", 4096), ("3T", 3 * 10**12), ("1TiB", 2**40), ("100", 100), ("100B", 100),
    ("1e9", 10**9), (" 7 MB ", 7 * 10**6), ("0", 0), ("2.5K", 2500), (4096, 4096),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "two GB", "2 XB", "inf", "nan", "1e400", "-1GB", "1.2.3MB"])
def test_parse_bytes_refuses(text):
    with pytest.raises(NanoError, match="byte size"):
        parse_bytes(text)
