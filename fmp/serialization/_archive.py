"""The zip archive `torch.save` writes: whether a file holds it and nothing else."""

from __future__ import annotations

from typing import BinaryIO

__all__ = ["bytes_outside_archive"]

_END_SIGNATURE = b"PK\x05\x06"
_END_RECORD = 22  # bytes in the end-of-central-directory record, its comment not counted
_LONGEST_COMMENT = 0xFFFF
_ZIP64_LOCATOR_SIGNATURE = b"PK\x06\x07"
_ZIP64_LOCATOR = 20  # bytes in the zip64 end-record locator, which torch writes just before the end record
_ZIP64_END_RECORD = 56  # bytes in the zip64 end record, its extensible data not counted


def _number(record: bytes, start: int, size: int) -> int:
    return int.from_bytes(record[start : start + size], "little")


def bytes_outside_archive(file: BinaryIO) -> str | None:
    """What lies in `file` outside its zip archive, in words, or None where the archive is the whole file.

    Zip readers find an archive from its end record and ignore what precedes or follows it, so
    bytes appended to a checkpoint, or a checkpoint written twice into one file, would load as if
    absent. The archive's end record is the one whose comment ends the file; the records before it
    (the zip64 end record, then the central directory) must lie where their offsets say, counted
    from the file's start. A file with no end record is no zip archive: None, for the format check
    to refuse.

    Args:
        file: A binary file open for reading; its position is moved.

    Returns:
        None, or what is wrong, e.g. "40 bytes follow the end of its zip archive".
    """
    size = file.seek(0, 2)
    tail_start = max(0, size - _END_RECORD - _LONGEST_COMMENT)
    file.seek(tail_start)
    tail = file.read()
    ends = []  # (start, end) of each end record in the tail, the last first
    at = tail.rfind(_END_SIGNATURE)
    while at >= 0:
        ends.append((at, at + _END_RECORD + _number(tail, at + 20, 2)))
        at = tail.rfind(_END_SIGNATURE, 0, at)
    closing = [start for start, end in ends if end == len(tail)]
    if not closing:
        inside = [end for _, end in ends if end < len(tail)]
        if inside:
            return f"{len(tail) - inside[0]} bytes follow the end of its zip archive"
        return "the file ends inside its zip archive's end record" if ends else None
    end_record = tail_start + closing[0]
    locator = b""
    if end_record >= _ZIP64_LOCATOR:
        file.seek(end_record - _ZIP64_LOCATOR)
        locator = file.read(_ZIP64_LOCATOR)
    if locator.startswith(_ZIP64_LOCATOR_SIGNATURE):
        # The zip64 end record, where the locator says it starts; it ends where the locator begins.
        claimed_start = _number(locator, 8, 8)
        if claimed_start > end_record - _ZIP64_LOCATOR - _ZIP64_END_RECORD:
            return "its zip64 end record lies outside the file"
        file.seek(claimed_start)
        record = file.read(_ZIP64_END_RECORD)
        records_start = end_record - _ZIP64_LOCATOR - (12 + _number(record, 4, 8))
        directory_start, directory_size = _number(record, 48, 8), _number(record, 40, 8)
    else:
        record = tail[closing[0] :]
        claimed_start = records_start = end_record
        directory_start, directory_size = _number(record, 16, 4), _number(record, 12, 4)
    if records_start != claimed_start:  # every offset is off by what lies before the archive
        return f"{records_start - claimed_start} bytes precede its zip archive"
    if directory_start + directory_size != records_start:
        return "its central directory does not end where its end records begin"
    return None
