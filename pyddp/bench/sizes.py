"""Message sizes: nccl-tests-style parsing (``4K``, ``64M``, ``1G``) and sweeps."""

_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """Returns the number of bytes in ``text``: an integer with an optional K, M or G suffix.

    Suffixes are binary (``4K`` is 4096) and case-insensitive, as in nccl-tests.
    """
    stripped = text.strip().upper()
    suffix = stripped[-1:] if stripped[-1:] in _SUFFIXES else ""
    digits = stripped[: len(stripped) - len(suffix)]
    if not digits.isdigit():
        raise ValueError(f"{text!r} is not a size such as 4096, 4K, 64M or 1G")
    return int(digits) * _SUFFIXES[suffix]


def format_size(nbytes: int) -> str:
    """The shortest exact K/M/G spelling of ``nbytes`` (inverse of parse_size)."""
    for suffix in ("G", "M", "K"):
        unit = _SUFFIXES[suffix]
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def size_sweep(min_bytes: int, max_bytes: int, step_factor: int) -> list[int]:
    """``min_bytes``, ``min_bytes * step_factor``, ... up to and including ``max_bytes``."""
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"need 0 < min_bytes <= max_bytes, got {min_bytes} and {max_bytes}")
    if step_factor < 2:
        raise ValueError(f"step_factor must be at least 2, got {step_factor}")
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= step_factor
    return sizes
