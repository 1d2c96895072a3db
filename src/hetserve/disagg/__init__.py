"""Prefill/decode disaggregation: export a prefilled request's KV pages and state from one
engine, import them into another, which continues decoding. Pure functions over EngineCore:
no sockets, no processes (serving/ moves the bytes)."""

from .transfer import KVExport, NoRoomYet, TransferError, export_request, import_request

__all__ = ["KVExport", "NoRoomYet", "TransferError", "export_request", "import_request"]
