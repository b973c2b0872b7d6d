"""The host side of the engine component on Wasmtime's Python component API:
loading the component, the import functions (store, clock, results), the
conversion of values, and the policy in the Rust crate's field names.

The conformance runner (tests/conformance/python/run.py) builds its mock
store on these functions: there is one copy of the marshalling.
"""

from __future__ import annotations

import ctypes
import json
import struct
import threading
import weakref
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Optional

import wasmtime
from wasmtime import _ffi as ffi
from wasmtime.component import Component, Linker, Record, Variant
from wasmtime.component._types import ListType, ResultType

PACKAGE = "idem:engine/{}@0.4.0"
# The largest integer a SQL column holds.
I64_MAX = (1 << 63) - 1

# wasmtime-py represents a `result` untagged (the bare ok or err value) when
# the Python classes of its two cases do not overlap. For
# `result<option<T>, store-error>` (store.get, results.find-result) that
# makes the err case impossible to return: None's class, `object`, matches
# every value, so an error is lowered as the ok case and fails. Tagging every
# result (`Variant("ok", v)` / `Variant("err", e)`) removes the ambiguity.
ResultType._tagged = lambda self: True  # type: ignore[method-assign]

# ------------------------------------------------------------ list<u8> fast path
#
# wasmtime-py converts a `list<u8>` one element at a time through ctypes
# (a pointer object and two attribute writes per byte: about 4 us a byte).
# Here a byte string is laid out as the C array of `wasmtime_component_val_t`
# in one pass of slice assignments, and read back the same way.

_VAL = ffi.wasmtime_component_val_t
_VAL_SIZE = ctypes.sizeof(_VAL)
_VAL_OF = _VAL.of.offset
_U8_KIND = ffi.WASMTIME_COMPONENT_U8.value
# The layout shared by wasm_byte_vec_t and the C API's list and record
# vectors: the length, then the pointer to the elements (native sizes).
# Read from a ctypes structure's buffer, it gives the pointer as an int
# without a `ctypes.cast`.
_VEC = struct.Struct("NP")
_orig_to_c = ListType.convert_to_c
_orig_from_c = ListType.convert_from_c


def _is_bytes(self: ListType) -> bool:
    # `element` asks the C API for a new type object each time: ask once.
    cached = self.__dict__.get("_idem_is_bytes")
    if cached is None:
        cached = self._is_bytes()
        self.__dict__["_idem_is_bytes"] = cached
    return cached


def _bytes_to_c(self: ListType, store: Any, val: Any, ptr: Any) -> None:
    if not (isinstance(val, (bytes, bytearray, memoryview)) and _is_bytes(self)):
        return _orig_to_c(self, store, val, ptr)
    data = bytes(val)
    n = len(data)
    raw = ffi.wasmtime_component_vallist_t()
    ffi.wasmtime_component_vallist_new_uninit(raw, n)
    if n:
        buf = bytearray(n * _VAL_SIZE)
        buf[0::_VAL_SIZE] = bytes((_U8_KIND,)) * n
        buf[_VAL_OF::_VAL_SIZE] = data
        ctypes.memmove(raw.data, (ctypes.c_char * len(buf)).from_buffer(buf), len(buf))
    ptr.contents.kind = ffi.WASMTIME_COMPONENT_LIST
    ptr.contents.of.list = raw
    return None


def _bytes_from_c(self: ListType, c: Any) -> Any:
    if not _is_bytes(self):
        return _orig_from_c(self, c)
    vec = c.of.list
    n, address = _VEC.unpack_from(vec)
    try:
        if n == 0:
            return b""
        return ctypes.string_at(address, n * _VAL_SIZE)[_VAL_OF::_VAL_SIZE]
    finally:
        ffi.wasmtime_component_vallist_delete(ctypes.byref(vec))


ListType.convert_to_c = _bytes_to_c  # type: ignore[method-assign]
ListType.convert_from_c = _bytes_from_c  # type: ignore[method-assign]


# ------------------------------------------------------------ cached types
#
# wasmtime-py asks the C API for every function's type, and for each
# record's fields, variant's cases, list's element, ... on every call and
# every conversion: thousands of FFI calls and type objects per `begin`
# (about 8 ms a call). Types never change, so they are asked once: each
# type object keeps what it was told, and the functions below keep the type
# of each export and import.

from wasmtime.component import _types as _t  # noqa: E402
from wasmtime.component._enter import catch_exceptions, enter_wasm  # noqa: E402


def _memo_property(cls: type, name: str) -> None:
    getter = getattr(cls, name).fget
    slot = f"_idem_{name}"

    def cached(self: Any) -> Any:
        d = self.__dict__
        if slot not in d:
            d[slot] = getter(self)
        return d[slot]

    setattr(cls, name, property(cached))


def _memo_method(cls: type, name: str) -> None:
    method = getattr(cls, name)
    slot = f"_idem_{name}"

    def cached(self: Any) -> Any:
        d = self.__dict__
        if slot not in d:
            d[slot] = method(self)
        return d[slot]

    setattr(cls, name, cached)


for _cls, _names in ((_t.ListType, ("element",)), (_t.RecordType, ("fields",)), (_t.TupleType, ("elements",)),
                     (_t.VariantType, ("cases",)), (_t.EnumType, ("names",)), (_t.OptionType, ("payload",)),
                     (_t.ResultType, ("ok", "err")), (_t.FlagsType, ("names",))):
    for _name in _names:
        _memo_property(_cls, _name)
for _cls in (_t.VariantType, _t.OptionType, _t.ResultType):
    _memo_method(_cls, "_cases")
    _memo_method(_cls, "_tagged")


# Strings and record field names: one FFI call each instead of three, and
# field names encoded once per record type.
from wasmtime._ffi import dll as _dll  # noqa: E402

# wasm_byte_vec_new on its own function object (indexing the library makes a
# new one), taking the bytes as they are: no copy into a ctypes array first.
_vec_new = _dll["wasm_byte_vec_new"]
_vec_new.argtypes = [ctypes.POINTER(ffi.wasm_byte_vec_t), ctypes.c_size_t, ctypes.c_char_p]
_vec_new.restype = None
_vec_t = ffi.wasm_byte_vec_t
_byref = ctypes.byref


def _bytes_vec(b: bytes) -> Any:
    vec = _vec_t()
    _vec_new(_byref(vec), len(b), b)
    return vec


def _str_to_capi(s: str) -> Any:
    if not isinstance(s, str):
        raise TypeError("expected a string")
    return _bytes_vec(s.encode("utf-8"))


ffi.str_to_capi = _str_to_capi


class Lowered:
    """A value lowered once, for values that do not change between calls,
    such as a policy: laid out in its own arena (see "calls: arenas and
    snapshots" below), kept for the life of this object, and copied into
    each call that passes it as its top `wasmtime_component_val_t` only
    (32 bytes; what it points at stays in this arena, which the C API only
    reads). It may stand for the value as an export's argument or as a
    record field."""

    __slots__ = ("top", "_arena", "_pinned", "_base", "_low")

    def __init__(self, ty: Any, value: Any):
        # The lowering function is kept too: the arena points at the names
        # (record fields, variant cases) its `_Names` buffers hold.
        self._low = _lowerer(ty)
        self._arena, self._pinned, self._base = _lower_all([self._low], (value,))
        self.top = bytes(self._arena[:32])

    def copy_to(self, ptr: Any) -> None:
        """A deep copy into `ptr`, owned by the caller (wasmtime-py's conversions)."""
        _clone_at(self._base, ctypes.cast(ptr, ctypes.c_void_p).value)


_val_clone = ffi.wasmtime_component_val_clone
_val_delete = ffi.wasmtime_component_val_delete


# A record is lowered into a copy of a template: the record with its field
# names and every value `false`, made once per record type. One
# `wasmtime_component_valrecord_copy` allocates all the names (instead of
# one C call per name); then each value is written in place into the
# copy's entries. Integers, booleans, strings, enums and absent options are
# written with `struct.pack_into` straight into that memory (no ctypes
# object per field; native byte order, standard sizes, at the union's
# offset); any other value goes through its type's conversion.

_ENTRY = ffi.wasmtime_component_valrecord_entry_t
_ENTRY_SIZE = ctypes.sizeof(_ENTRY)
_ENTRY_VAL = _ENTRY.val.offset
_OF = _VAL.of.offset
_record_copy = ffi.wasmtime_component_valrecord_copy
_record_delete = ffi.wasmtime_component_valrecord_delete
# wasm_byte_vec_new writing the new vector at an address.
_vec_new_at = _dll["wasm_byte_vec_new"]
_vec_new_at.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_vec_new_at.restype = None
_KIND_ONLY = struct.Struct("=B")
_KIND_NULL = struct.Struct(f"B{_OF - 1}xP")  # an option's `none`: the kind and a null pointer


def _field_writer(ty: Any) -> Any:
    """How a field of type `ty` is written in place: (how, struct, kind),
    how being "int", "bool", "str", "option" or None (the type's own
    conversion)."""
    for cls, kind, fmt, mask in ((_t.U8, "U8", "B", 0xFF), (_t.U16, "U16", "H", 0xFFFF),
                                 (_t.U32, "U32", "I", 0xFFFFFFFF), (_t.U64, "U64", "Q", (1 << 64) - 1),
                                 (_t.S32, "S32", "I", 0xFFFFFFFF), (_t.S64, "S64", "Q", (1 << 64) - 1)):
        if type(ty) is cls:
            # Masked like a ctypes integer field (what the type's own conversion does).
            return ("int", struct.Struct(f"=B{_OF - 1}x{fmt}"), getattr(ffi, f"WASMTIME_COMPONENT_{kind}").value, mask)
    if type(ty) is _t.Bool:
        return ("bool", struct.Struct(f"=B{_OF - 1}x?"), ffi.WASMTIME_COMPONENT_BOOL.value, None)
    if type(ty) is _t.String:
        return ("str", None, _STRING, None)
    if type(ty) is _t.EnumType:
        return ("str", None, _ENUM, None)
    if type(ty) is _t.OptionType and not ty._tagged():
        # `some` of an integer, a string or an enum is built here too (mask: the payload's writer).
        payload = ty.payload
        inner = _field_writer(payload)
        return ("option", None, _OPTION, (payload,) + inner if inner[0] in ("int", "str") else None)
    return (None, None, None, None)


# wasmtime_component_val_new (moves a value into a new box) on an address.
_val_new_at = _dll["wasmtime_component_val_new"]
_val_new_at.argtypes = [ctypes.c_void_p]
_val_new_at.restype = ctypes.c_void_p


def _some_to_c(inner: Any, v: Any, mem: Any, off: int) -> None:
    """`some(v)` of an integer, string or enum option, written at mem[off]."""
    _ty, how, st, kind, mask = inner
    tmp = ctypes.create_string_buffer(_VAL_SIZE)
    if how == "int":
        if not isinstance(v, int):
            raise TypeError(f"expected int for {type(_ty).__name__} type")
        st.pack_into(tmp, 0, kind, v & mask)
    else:
        if not isinstance(v, str):
            raise TypeError("expected string type" if kind == _STRING else "expected str type")
        b = v.encode("utf-8")
        _KIND_ONLY.pack_into(tmp, 0, kind)
        _vec_new_at(ctypes.addressof(tmp) + _OF, len(b), b)
    _KIND_NULL.pack_into(mem, off, _OPTION, _val_new_at(ctypes.addressof(tmp)))


def _record_template(self: Any) -> Any:
    d = self.__dict__
    tpl = d.get("_idem_template")
    if tpl is None:
        fields = self.fields
        raw = ffi.wasmtime_component_valrecord_t()
        ffi.wasmtime_component_valrecord_new_uninit(raw, len(fields))
        for i, (name, _ty) in enumerate(fields):
            entry = raw.data[i]
            entry.name = _str_to_capi(name)
            entry.val.kind = ffi.WASMTIME_COMPONENT_BOOL
            entry.val.of.boolean = False
        writers = [(name, ty) + _field_writer(ty) for name, ty in fields]
        tpl = d["_idem_template"] = (raw, writers, len(fields) * _ENTRY_SIZE)
        # Freed with the type object (each instance's function types are its own).
        weakref.finalize(self, _record_delete, _byref(raw))
    return tpl


_ZERO_VAL = bytes(_VAL_SIZE)


def _record_to_c(self: Any, store: Any, val: Any, ptr: Any) -> None:
    if type(val) is Lowered:
        return val.copy_to(ptr)
    template, writers, size = _record_template(self)
    raw = ffi.wasmtime_component_valrecord_t()
    _record_copy(_byref(raw), _byref(template))
    base = _VEC.unpack_from(raw)[1]
    mem = (ctypes.c_char * size).from_address(base)
    off = _ENTRY_VAL
    try:
        for name, ty, how, st, kind, mask in writers:
            v = getattr(val, name)
            if how == "int":
                if not isinstance(v, int):
                    raise TypeError(f"expected int for {type(ty).__name__} type")
                st.pack_into(mem, off, kind, v & mask)
            elif how == "str":
                if not isinstance(v, str):
                    raise TypeError("expected string type" if kind == _STRING else "expected str type")
                b = v.encode("utf-8")
                _KIND_ONLY.pack_into(mem, off, kind)
                _vec_new_at(base + off + _OF, len(b), b)
            elif how == "option" and v is None:
                _KIND_NULL.pack_into(mem, off, kind, 0)
            elif how == "option" and mask is not None:
                _some_to_c(mask, v, mem, off)
            elif how == "bool":
                if not isinstance(v, bool):
                    raise TypeError("expected bool for Bool type")
                st.pack_into(mem, off, kind, v)
            else:
                ty.convert_to_c(store, v, ctypes.pointer(_VAL.from_address(base + off)))
            off += _ENTRY_SIZE
    except BaseException:
        # The values from the failed one on are not ours to free: make them `false`.
        while off < size:
            mem[off:off + _VAL_SIZE] = _ZERO_VAL
            off += _ENTRY_SIZE
        _record_delete(_byref(raw))
        raise
    c = ptr.contents
    c.kind = ffi.WASMTIME_COMPONENT_RECORD
    c.of.record = raw
    return None


# A record is lifted from one snapshot of its entries (`string_at`):
# integers and booleans are unpacked from it, strings and enums decoded from
# the bytes they point at (left for the record's delete to free), an absent
# option read as None; any other value goes through its type's conversion,
# which frees what it owns, and is then marked `false` in the record.

_PTR = struct.Struct("P")
_string_at = ctypes.string_at
_memset = ctypes.memset


def _field_reader(ty: Any) -> Any:
    for cls, fmt in ((_t.U8, "B"), (_t.U16, "H"), (_t.U32, "I"), (_t.U64, "Q"), (_t.S32, "i"), (_t.S64, "q"),
                     (_t.Bool, "?")):
        if type(ty) is cls:
            return ("num", struct.Struct(f"={fmt}"))
    if type(ty) in (_t.String, _t.EnumType):
        return ("str", None)
    if type(ty) is _t.OptionType and not ty._tagged():
        return ("option", None)
    return (None, None)


def _record_from_c(self: Any, c: Any) -> Any:
    d = self.__dict__
    readers = d.get("_idem_readers")
    if readers is None:
        readers = d["_idem_readers"] = [(name, ty) + _field_reader(ty) for name, ty in self.fields]
    rec = c.of.record
    try:
        ret = Record()
        out = ret.__dict__
        size, base = _VEC.unpack_from(rec)
        snap = _string_at(base, size * _ENTRY_SIZE) if size else b""
        off = _ENTRY_VAL
        for (name, ty, how, st), _ in zip(readers, range(size)):
            if how == "num":
                out[name] = st.unpack_from(snap, off + _OF)[0]
            elif how == "str":
                n, p = _VEC.unpack_from(snap, off + _OF)
                out[name] = _string_at(p, n).decode("utf-8") if n else ""
            elif how == "option" and _PTR.unpack_from(snap, off + _OF)[0] == 0:
                out[name] = None
            else:
                out[name] = ty.convert_from_c(_VAL.from_address(base + off))
                _memset(base + off, 0, _VAL_SIZE)  # freed by the conversion: now `false`
            off += _ENTRY_SIZE
        return ret
    finally:
        _record_delete(_byref(rec))


_t.RecordType.convert_to_c = _record_to_c
_t.RecordType.convert_from_c = _record_from_c


# The scalar conversions with one `contents` lookup instead of two and
# plain integer kinds, and `option` without its generic case search.


def _scalar(cls: type, kind: Any, field: str, check: type) -> None:
    k = kind.value
    tname = cls.__name__

    def to_c(self: Any, store: Any, val: Any, ptr: Any) -> None:
        if not isinstance(val, check):
            raise TypeError(f"expected {check.__name__} for {tname} type")
        c = ptr.contents
        c.kind = k
        setattr(c.of, field, val)

    cls.convert_to_c = to_c


for _cls, _kind, _field, _check in ((_t.U8, ffi.WASMTIME_COMPONENT_U8, "u8", int),
                                     (_t.U16, ffi.WASMTIME_COMPONENT_U16, "u16", int),
                                     (_t.U32, ffi.WASMTIME_COMPONENT_U32, "u32", int),
                                     (_t.U64, ffi.WASMTIME_COMPONENT_U64, "u64", int),
                                     (_t.S32, ffi.WASMTIME_COMPONENT_S32, "s32", int),
                                     (_t.S64, ffi.WASMTIME_COMPONENT_S64, "s64", int),
                                     (_t.Bool, ffi.WASMTIME_COMPONENT_BOOL, "boolean", bool)):
    _scalar(_cls, _kind, _field, _check)

_STRING = ffi.WASMTIME_COMPONENT_STRING.value
_ENUM = ffi.WASMTIME_COMPONENT_ENUM.value
_OPTION = ffi.WASMTIME_COMPONENT_OPTION.value


def _string_to_c(self: Any, store: Any, val: Any, ptr: Any) -> None:
    if not isinstance(val, str):
        raise TypeError("expected string type")
    c = ptr.contents
    c.kind = _STRING
    c.of.string = _bytes_vec(val.encode("utf-8"))


def _enum_to_c(self: Any, store: Any, val: Any, ptr: Any) -> None:
    if not isinstance(val, str):
        raise TypeError("expected str type")
    c = ptr.contents
    c.kind = _ENUM
    c.of.enumeration = _bytes_vec(val.encode("utf-8"))


_orig_option_to_c = _t.OptionType.convert_to_c


def _option_to_c(self: Any, store: Any, val: Any, ptr: Any) -> None:
    if self._tagged():
        return _orig_option_to_c(self, store, val, ptr)
    c = ptr.contents
    if val is None:
        c.kind = _OPTION
        c.of.option = None
        return None
    raw = ffi.wasmtime_component_val_t()
    self.payload.convert_to_c(store, val, ctypes.pointer(raw))
    c.kind = _OPTION
    c.of.option = ffi.wasmtime_component_val_new(ctypes.byref(raw))
    return None


_t.String.convert_to_c = _string_to_c
_t.EnumType.convert_to_c = _enum_to_c
_t.OptionType.convert_to_c = _option_to_c


# Lifting variants, options and results: the case found in a dict made once
# per type (instead of a search of the case list), the tag and strings read
# with one `string_at`. Payloads are then handled as wasmtime-py does (the
# payload's own conversion, the payload marked `false`, then deleted).

_BOOL = ffi.WASMTIME_COMPONENT_BOOL.value


def _case_map(self: Any) -> dict:
    d = self.__dict__
    m = d.get("_idem_case_map")
    if m is None:
        m = d["_idem_case_map"] = dict(self._cases())
    return m


def _lift(self: Any, tag: str, ptr: Any) -> Any:
    cases = _case_map(self)
    if tag not in cases:
        raise ValueError(f"tag {tag} not found in variant cases")
    ty = cases[tag]
    tagged = self._tagged()
    if ty is None:
        return Variant(tag) if tagged else None
    c = ptr.contents
    payload = ty.convert_from_c(c)
    c.kind = _BOOL
    c.of.boolean = False
    _val_delete(ptr)
    return Variant(tag, payload) if tagged else payload


def _variant_from_c(self: Any, c: Any) -> Any:
    v = c.of.variant
    n, p = _VEC.unpack_from(v)
    tag = _string_at(p, n).decode("utf-8") if n else ""
    ffi.wasm_byte_vec_delete(_byref(v.discriminant))
    return _lift(self, tag, v.val)


def _option_from_c(self: Any, c: Any) -> Any:
    ptr = c.of.option
    return _lift(self, "some" if ptr else "none", ptr)


def _result_from_c(self: Any, c: Any) -> Any:
    r = c.of.result
    return _lift(self, "ok" if r.is_ok else "err", r.val)


def _string_from_c(self: Any, c: Any) -> Any:
    vec = c.of.string
    n, p = _VEC.unpack_from(vec)
    try:
        return _string_at(p, n).decode("utf-8") if n else ""
    finally:
        ffi.wasm_byte_vec_delete(_byref(vec))


for _cls in (_t.VariantType, _t.OptionType, _t.ResultType):
    _cls._lift = _lift
_t.VariantType.convert_from_c = _variant_from_c
_t.OptionType.convert_from_c = _option_from_c
_t.ResultType.convert_from_c = _result_from_c
_t.String.convert_from_c = _string_from_c
_t.EnumType.convert_from_c = _string_from_c  # an enum's case is its name, as a string


# ------------------------------------------------------------ calls: arenas and snapshots
#
# A call's arguments (and an import's result) are laid out as the C API's
# `wasmtime_component_val_t` tree in one Python buffer (an arena): every
# list, record, string and option payload is a range of that buffer, and
# its pointers are the buffer's address plus an offset, written once the
# buffer is complete. The C API only reads an export's arguments (it
# converts them into its own values), so the arena is passed as it is: no
# allocation in Wasmtime, nothing to free. An import's result is owned by
# the C API, which frees it: the arena is copied into its allocations with
# one `wasmtime_component_val_clone` (a deep copy). A `list<u8>` is laid out
# with two slice assignments (the kinds, then the bytes).
#
# Results (an export's result, an import's arguments) are read from
# snapshots (`string_at`) of each array the tree points at, and freed once,
# by the owner: `wasmtime_component_val_delete` on an export's result, the
# C API for an import's arguments.
#
# Each type is compiled once into a lowering function `low(value, buf, at,
# fix)`, which writes the value at `buf[at:at + 32]` and appends what it
# points at (recording each pointer's place and target in `fix`), and a
# lifting function `lift(snapshot, at)`. The checks and errors are
# wasmtime-py's (wrong Python types raise TypeError, a value no case of an
# untagged variant takes raises ValueError).

_KIND = {name: getattr(ffi, f"WASMTIME_COMPONENT_{name}").value for name in (
    "BOOL", "S8", "U8", "S16", "U16", "S32", "U32", "S64", "U64", "F32", "F64", "CHAR", "STRING", "LIST",
    "RECORD", "TUPLE", "VARIANT", "ENUM", "OPTION", "RESULT")}
_Q = struct.Struct("=Q")
_HEAD = struct.Struct("=B")
_HEAD_VEC = struct.Struct("=B7xQ")  # kind, size (the data pointer is a fixup)
_HEAD_VARIANT = struct.Struct("=B7xQQ")  # kind, discriminant size and address (the payload is a fixup)
_HEAD_RESULT = struct.Struct("=B7x?")
_PADS = [b"\0" * i for i in range(8)]
_ENTRY_NAME = struct.Struct("=QQ")
_c_char = ctypes.c_char
_addressof = ctypes.addressof

if _VAL_SIZE != 32 or _OF != 8 or _ENTRY_SIZE != 48 or _ENTRY_VAL != 16:
    raise ImportError("idem: this wasmtime's component value layout is not the one the package knows")

# The C functions on their own function objects, taking addresses.
_clone_at = _dll["wasmtime_component_val_clone"]
_clone_at.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
_clone_at.restype = None
_delete_at = _dll["wasmtime_component_val_delete"]
_delete_at.argtypes = [ctypes.c_void_p]
_delete_at.restype = None


class _Names:
    """Strings that a type's values point at (record field names, variant
    case names), in one buffer kept for the life of the process' types."""

    def __init__(self, names: list[str]):
        blob = b"".join(n.encode("utf-8") for n in names) or b"\0"
        self.buf = ctypes.create_string_buffer(blob, len(blob))
        base = _addressof(self.buf)
        self.at = []
        off = 0
        for n in names:
            b = n.encode("utf-8")
            self.at.append((len(b), base + off if b else 0))
            off += len(b)


def _relocate(buf: bytearray, fix: list) -> tuple:
    """Pins the arena and writes its pointers: (the pinning array, address)."""
    pinned = (_c_char * len(buf)).from_buffer(buf)
    base = _addressof(pinned)
    pack = _Q.pack_into
    it = iter(fix)
    for pos, target in zip(it, it):
        pack(buf, pos, base + target)
    return pinned, base


def _compiled(ty: Any, slot: str, compile: Callable[[Any], Any]) -> Any:
    """`compile(ty)`, made once per type object and kept on it."""
    d = ty.__dict__
    f = d.get(slot)
    if f is None:
        f = d[slot] = compile(ty)
    return f


def _lowerer(ty: Any) -> Callable[..., None]:
    return _compiled(ty, "_idem_low", _compile_lower)


def _lifter(ty: Any) -> Callable[..., Any]:
    return _compiled(ty, "_idem_lift", _compile_lift)


_INTS = {_t.S8: ("S8", "b", 0xFF), _t.U8: ("U8", "B", 0xFF), _t.S16: ("S16", "H", 0xFFFF),
         _t.U16: ("U16", "H", 0xFFFF), _t.S32: ("S32", "I", 0xFFFFFFFF), _t.U32: ("U32", "I", 0xFFFFFFFF),
         _t.S64: ("S64", "Q", (1 << 64) - 1), _t.U64: ("U64", "Q", (1 << 64) - 1)}
_INTS_LIFT = {_t.S8: "b", _t.U8: "B", _t.S16: "h", _t.U16: "H", _t.S32: "i", _t.U32: "I", _t.S64: "q", _t.U64: "Q"}


def _case_classes(ty: Any) -> Optional[tuple]:
    if ty is None:
        return None
    s: set = set()
    ty.add_classes(s)
    return tuple(s)


def _compile_lower(ty: Any) -> Callable[..., None]:  # noqa: C901 - one case per kind of type
    cls = type(ty)
    if cls in _INTS:
        name, fmt, mask = _INTS[cls]
        kind = _KIND[name]
        st = struct.Struct(f"=B7x{'B' if fmt == 'b' else fmt}")
        msg = f"expected int for {cls.__name__} type"

        def low_int(v: Any, buf: bytearray, at: int, fix: list) -> None:
            if not isinstance(v, int):
                raise TypeError(msg)
            st.pack_into(buf, at, kind, v & mask)
        return low_int
    if cls is _t.Bool:
        st = struct.Struct("=B7x?")
        kind = _KIND["BOOL"]

        def low_bool(v: Any, buf: bytearray, at: int, fix: list) -> None:
            if not isinstance(v, bool):
                raise TypeError("expected bool for Bool type")
            st.pack_into(buf, at, kind, v)
        return low_bool
    if cls in (_t.F32, _t.F64):
        kind = _KIND["F32" if cls is _t.F32 else "F64"]
        st = struct.Struct("=B7xf" if cls is _t.F32 else "=B7xd")

        msg = f"expected float for {cls.__name__} type"

        def low_float(v: Any, buf: bytearray, at: int, fix: list) -> None:
            if not isinstance(v, float):
                raise TypeError(msg)
            st.pack_into(buf, at, kind, v)
        return low_float
    if cls is _t.Char:
        st = struct.Struct("=B7xI")
        kind = _KIND["CHAR"]

        def low_char(v: Any, buf: bytearray, at: int, fix: list) -> None:
            if not isinstance(v, str) or len(v) != 1:
                raise TypeError("expected single-character string for Char type")
            st.pack_into(buf, at, kind, ord(v))
        return low_char
    if cls in (_t.String, _t.EnumType):
        kind = _KIND["STRING" if cls is _t.String else "ENUM"]
        msg = "expected string type" if cls is _t.String else "expected str type"
        head = _HEAD_VEC.pack_into
        only = _HEAD.pack_into

        def low_str(v: Any, buf: bytearray, at: int, fix: list) -> None:
            if not isinstance(v, str):
                raise TypeError(msg)
            b = v.encode("utf-8")
            n = len(b)
            if n:
                off = len(buf)
                buf += b
                buf += _PADS[-n & 7]
                head(buf, at, kind, n)
                fix += (at + 16, off)
            else:
                only(buf, at, kind)
        return low_str
    if cls is _t.ListType:
        kind = _KIND["LIST"]
        head = _HEAD_VEC.pack_into
        if ty._is_bytes():
            u8 = bytes((_KIND["U8"],))

            def low_bytes(v: Any, buf: bytearray, at: int, fix: list) -> None:
                if not isinstance(v, (bytes, bytearray, memoryview)):
                    raise TypeError("expected bytes value")
                if type(v) is not bytes:
                    v = bytes(v)
                n = len(v)
                head(buf, at, kind, n)
                if n:
                    off = len(buf)
                    end = off + 32 * n
                    buf += bytes(32 * n)
                    buf[off:end:32] = u8 * n
                    buf[off + 8:end:32] = v
                    fix += (at + 16, off)
            return low_bytes
        element = ty.element

        def low_list(v: Any, buf: bytearray, at: int, fix: list) -> None:
            if not isinstance(v, list):
                raise TypeError("expected list value")
            n = len(v)
            head(buf, at, kind, n)
            if n:
                el = _lowerer(element)
                off = len(buf)
                buf += bytes(32 * n)
                fix += (at + 16, off)
                for e in v:
                    el(e, buf, off, fix)
                    off += 32
        return low_list
    if cls is _t.TupleType:
        kind = _KIND["TUPLE"]
        head = _HEAD_VEC.pack_into
        elements = ty.elements
        count = len(elements)

        def low_tuple(v: Any, buf: bytearray, at: int, fix: list) -> None:
            if not isinstance(v, tuple):
                raise TypeError("expected tuple type")
            if len(v) != count:
                raise TypeError("tuple length mismatch")
            head(buf, at, kind, count)
            if count:
                off = len(buf)
                buf += bytes(32 * count)
                fix += (at + 16, off)
                for t, e in zip(elements, v):
                    _lowerer(t)(e, buf, off, fix)
                    off += 32
        return low_tuple
    if cls is _t.RecordType:
        return _compile_lower_record(ty)
    if cls in (_t.VariantType, _t.OptionType, _t.ResultType):
        return _compile_lower_variant(ty, cls)
    raise NotImplementedError(f"idem: values of {cls.__name__} are not supported")


def _compile_lower_record(ty: Any) -> Callable[..., None]:
    """A record's lowering as straight-line code (generated once per record
    type): integers, booleans, strings, enums and absent untagged options
    written in place, any other field by its type's function."""
    fields = ty.fields
    names = _Names([n for n, _ in fields])
    template = bytearray(48 * len(fields))
    for i, (size, address) in enumerate(names.at):
        _ENTRY_NAME.pack_into(template, 48 * i, size, address)
    ns: dict = {"Lowered": Lowered, "template": bytes(template), "head": _HEAD_VEC.pack_into, "only": _HEAD.pack_into,
                "PADS": _PADS, "KIND": _KIND["RECORD"], "names": names, "lowerer": _lowerer}
    code = ["def low_record(v, buf, at, fix):",
            "    if type(v) is Lowered:",
            "        buf[at:at + 32] = v.top",
            "        return",
            "    off = len(buf)",
            "    buf += template",
            f"    head(buf, at, KIND, {len(fields)})"]
    if fields:
        code.append("    fix += (at + 16, off)")
    for i, (name, t) in enumerate(fields):
        fa = 48 * i + 16
        tc = type(t)
        ns[f"N{i}"] = name
        ns[f"T{i}"] = t
        code.append(f"    x = getattr(v, N{i})")
        if tc in _INTS or tc is _t.Bool:
            if tc is _t.Bool:
                ns[f"S{i}"] = struct.Struct("=B7x?").pack_into
                code += [f"    if not isinstance(x, bool): raise TypeError('expected bool for Bool type')",
                         f"    S{i}(buf, off + {fa}, {_KIND['BOOL']}, x)"]
            else:
                kname, fmt, mask = _INTS[tc]
                ns[f"S{i}"] = struct.Struct(f"=B7x{'B' if fmt == 'b' else fmt}").pack_into
                ns[f"M{i}"] = f"expected int for {tc.__name__} type"
                code += [f"    if not isinstance(x, int): raise TypeError(M{i})",
                         f"    S{i}(buf, off + {fa}, {_KIND[kname]}, x & {mask})"]
        elif tc in (_t.String, _t.EnumType):
            kind = _KIND["STRING" if tc is _t.String else "ENUM"]
            ns[f"M{i}"] = "expected string type" if tc is _t.String else "expected str type"
            code += [f"    if not isinstance(x, str): raise TypeError(M{i})",
                     "    b = x.encode('utf-8')",
                     "    n = len(b)",
                     "    if n:",
                     "        o = len(buf)",
                     "        buf += b",
                     "        buf += PADS[-n & 7]",
                     f"        head(buf, off + {fa}, {kind}, n)",
                     f"        fix += (off + {fa + 16}, o)",
                     "    else:",
                     f"        only(buf, off + {fa}, {kind})"]
        elif tc is _t.OptionType and not t._tagged():
            code += ["    if x is None:",
                     f"        only(buf, off + {fa}, {_KIND['OPTION']})",
                     "    else:",
                     f"        lowerer(T{i})(x, buf, off + {fa}, fix)"]
        else:
            code.append(f"    lowerer(T{i})(x, buf, off + {fa}, fix)")
    exec("\n".join(code), ns)  # noqa: S102 - generated from the type's field list only
    return ns["low_record"]


def _compile_lift_record(ty: Any) -> Callable[..., Any]:
    """A record's lifting as straight-line code (generated once per record
    type), from one snapshot of its entries."""
    fields = ty.fields
    ns: dict = {"Record": Record, "vec": _VEC.unpack_from, "string_at": _string_at, "lifter": _lifter,
                "ptr": _PTR.unpack_from}
    code = ["def lift_record(s, at):",
            "    n, p = vec(s, at + 8)",
            f"    if n != {len(fields)}: return generic(s, at)",
            f"    e = string_at(p, {48 * len(fields)})" if fields else "    e = b''",
            "    ret = Record()",
            "    d = ret.__dict__"]
    for i, (name, t) in enumerate(fields):
        va = 48 * i + 16 + 8  # the value's union
        tc = type(t)
        ns[f"N{i}"] = name
        ns[f"T{i}"] = t
        if tc in _INTS_LIFT or tc is _t.Bool:
            ns[f"U{i}"] = struct.Struct("=" + ("?" if tc is _t.Bool else _INTS_LIFT[tc])).unpack_from
            code.append(f"    d[N{i}] = U{i}(e, {va})[0]")
        elif tc in (_t.String, _t.EnumType):
            code += [f"    n, p = vec(e, {va})",
                     f"    d[N{i}] = string_at(p, n).decode('utf-8') if n else ''"]
        elif tc is _t.OptionType and not t._tagged():
            code.append(f"    d[N{i}] = lifter(T{i})(e, {va - 8}) if ptr(e, {va})[0] else None")
        else:
            code.append(f"    d[N{i}] = lifter(T{i})(e, {va - 8})")
    code.append("    return ret")

    def generic(s: bytes, at: int) -> Any:
        n, p = _VEC.unpack_from(s, at + 8)
        entries = _string_at(p, 48 * n) if n else b""
        ret = Record()
        for (name, t), i in zip(fields, range(16, 48 * n, 48)):
            ret.__dict__[name] = _lifter(t)(entries, i)
        return ret
    ns["generic"] = generic
    exec("\n".join(code), ns)  # noqa: S102 - generated from the type's field list only
    return ns["lift_record"]


def _compile_lower_variant(ty: Any, cls: type) -> Callable[..., None]:
    cases = ty._cases()
    tagged = ty._tagged()
    names = _Names([n for n, _ in cases])
    # (name, index, payload type, classes an untagged value of the case has)
    table = [(name, i, t, None if tagged else _case_classes(t)) for i, (name, t) in enumerate(cases)]
    by_tag = {row[0]: row for row in table}
    if cls is _t.VariantType:
        kind = _KIND["VARIANT"]

        def head(buf: bytearray, at: int, i: int) -> int:
            size, address = names.at[i]
            _HEAD_VARIANT.pack_into(buf, at, kind, size, address)
            return at + 24
    elif cls is _t.OptionType:
        kind = _KIND["OPTION"]

        def head(buf: bytearray, at: int, i: int) -> int:
            _HEAD.pack_into(buf, at, kind)
            return at + 8
    else:
        kind = _KIND["RESULT"]

        def head(buf: bytearray, at: int, i: int) -> int:
            _HEAD_RESULT.pack_into(buf, at, kind, i == 0)
            return at + 16

    def low_variant(v: Any, buf: bytearray, at: int, fix: list) -> None:
        if tagged:
            if not isinstance(v, Variant):
                raise TypeError("expected Variant type")
            row = by_tag.get(v.tag)
            if row is None:
                raise ValueError("value not valid for this variant")
            payload = v.payload
        else:
            for row in table:
                classes = row[3]
                if (v is None) if classes is None else isinstance(v, classes):
                    break
            else:
                raise ValueError("value not valid for this variant")
            payload = v
        _name, i, t, _classes = row
        ptr_at = head(buf, at, i)
        if t is not None:
            off = len(buf)
            buf += _ZERO_VAL
            fix += (ptr_at, off)
            _lowerer(t)(payload, buf, off, fix)
    low_variant._names = names  # type: ignore[attr-defined]
    return low_variant


def _compile_lift(ty: Any) -> Callable[..., Any]:  # noqa: C901 - one case per kind of type
    cls = type(ty)
    if cls in _INTS_LIFT or cls is _t.Bool or cls in (_t.F32, _t.F64):
        fmt = "?" if cls is _t.Bool else "f" if cls is _t.F32 else "d" if cls is _t.F64 else _INTS_LIFT[cls]
        unpack = struct.Struct("=" + fmt).unpack_from

        def lift_scalar(s: bytes, at: int) -> Any:
            return unpack(s, at + 8)[0]
        return lift_scalar
    if cls is _t.Char:
        unpack = struct.Struct("=I").unpack_from

        def lift_char(s: bytes, at: int) -> Any:
            return chr(unpack(s, at + 8)[0])
        return lift_char
    if cls in (_t.String, _t.EnumType):
        vec = _VEC.unpack_from

        def lift_str(s: bytes, at: int) -> Any:
            n, p = vec(s, at + 8)
            return _string_at(p, n).decode("utf-8") if n else ""
        return lift_str
    if cls is _t.ListType:
        vec = _VEC.unpack_from
        if ty._is_bytes():
            def lift_bytes(s: bytes, at: int) -> Any:
                n, p = vec(s, at + 8)
                return _string_at(p, 32 * n)[8::32] if n else b""
            return lift_bytes
        element = ty.element

        def lift_list(s: bytes, at: int) -> Any:
            n, p = vec(s, at + 8)
            if not n:
                return []
            el = _lifter(element)
            items = _string_at(p, 32 * n)
            return [el(items, i) for i in range(0, 32 * n, 32)]
        return lift_list
    if cls is _t.TupleType:
        vec = _VEC.unpack_from
        elements = ty.elements

        def lift_tuple(s: bytes, at: int) -> Any:
            n, p = vec(s, at + 8)
            items = _string_at(p, 32 * n) if n else b""
            return tuple(_lifter(t)(items, i) for t, i in zip(elements, range(0, 32 * n, 32)))
        return lift_tuple
    if cls is _t.RecordType:
        return _compile_lift_record(ty)
    if cls in (_t.VariantType, _t.OptionType, _t.ResultType):
        tagged = ty._tagged()
        cases = ty._cases()
        by_tag = dict(cases)
        ptr = _PTR.unpack_from
        vec = _VEC.unpack_from

        def payload(tag: str, p: int) -> Any:
            if tag not in by_tag:
                raise ValueError(f"tag {tag} not found in variant cases")
            t = by_tag[tag]
            if t is None:
                return Variant(tag) if tagged else None
            value = _lifter(t)(_string_at(p, 32), 0)
            return Variant(tag, value) if tagged else value
        if cls is _t.VariantType:
            def lift_variant(s: bytes, at: int) -> Any:
                n, p = vec(s, at + 8)
                return payload(_string_at(p, n).decode("utf-8") if n else "", ptr(s, at + 24)[0])
            return lift_variant
        if cls is _t.OptionType:
            def lift_option(s: bytes, at: int) -> Any:
                p = ptr(s, at + 8)[0]
                return payload("some" if p else "none", p)
            return lift_option
        is_ok = struct.Struct("=?").unpack_from

        def lift_result(s: bytes, at: int) -> Any:
            return payload("ok" if is_ok(s, at + 8)[0] else "err", ptr(s, at + 16)[0])
        return lift_result
    raise NotImplementedError(f"idem: values of {cls.__name__} are not supported")


_FLAT = frozenset(_INTS) | {_t.Bool, _t.F32, _t.F64, _t.Char}


class _Signature:
    """The parameter and result types of one function, asked once, with
    their lowering and lifting functions."""

    __slots__ = ("params", "result", "lower", "lift", "lift_params", "lower_result", "result_flat")

    def __init__(self, fty: Any):
        self.params = [ty for _, ty in fty.params]
        self.result = fty.result
        # An export lowers its parameters and lifts its result; an import the other way.
        self.lower = [_lowerer(ty) for ty in self.params]
        self.lift = _lifter(self.result) if self.result is not None else None
        self.lift_params = [_lifter(ty) for ty in self.params]
        self.lower_result = _lowerer(self.result) if self.result is not None else None
        # A result that can hold no pointer (a number, a bool, a char): handed to the C API as it is.
        self.result_flat = type(self.result) in _FLAT


def _lower_all(lowers: list, values: tuple) -> tuple:
    """The values as an arena of consecutive `wasmtime_component_val_t`:
    (the arena, its pinning array, its address)."""
    buf = bytearray(32 * len(values))
    fix: list = []
    at = 0
    for low, v in zip(lowers, values):
        if type(v) is Lowered:
            buf[at:at + 32] = v.top
        else:
            low(v, buf, at, fix)
        at += 32
    pinned, base = _relocate(buf, fix)
    return buf, pinned, base


def _call_export(func: Any, sig: _Signature, store: Any, params: tuple) -> Any:
    """`Func.__call__` with the function's types known."""
    if len(params) != len(sig.params):
        raise TypeError(f"wrong number of parameters provided: given {len(params)}, expected {len(sig.params)}")
    n = len(params)
    _buf, pinned, _base = _lower_all(sig.lower, params)
    args = (_VAL * n).from_buffer(_buf) if n else None
    if sig.result is None:
        enter_wasm(lambda: ffi.wasmtime_component_func_call(_byref(func._func), store._context(), args, n, None, 0))
        return None
    result = _VAL()
    enter_wasm(lambda: ffi.wasmtime_component_func_call(_byref(func._func), store._context(), args, n,
                                                         _byref(result), 1))
    try:
        return sig.lift(_string_at(_addressof(result), 32), 0)
    finally:
        _val_delete(_byref(result))


_IMPORTS: dict[int, list] = {}
_next_import = [1]


# The import callback with every pointer as a plain address (no ctypes
# pointer objects made per call, no casts).
_callback_t = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t)
_finalizer_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_linker_add_func = _dll["wasmtime_component_linker_instance_add_func"]
_linker_add_func.argtypes = [ctypes.POINTER(ffi.wasmtime_component_linker_instance_t), ctypes.c_char_p, ctypes.c_size_t,
                             _callback_t, ctypes.c_void_p, _finalizer_t]
_linker_add_func.restype = ctypes.POINTER(ffi.wasmtime_error_t)
_functype_p = ctypes.POINTER(ffi.wasmtime_component_func_type_t)
_memmove = ctypes.memmove


@_callback_t
def _import_impl(idx, context, ty_raw, args, nargs, results, nresults):  # type: ignore[no-untyped-def]
    entry = _IMPORTS[idx or 0]

    def run(store: Any) -> None:
        sig = entry[1]
        if sig is None:
            with _t.FuncType._from_ptr(ctypes.cast(ty_raw, _functype_p), owner=store) as fty:
                sig = entry[1] = _Signature(fty)
        # The arguments are the C API's: read, not freed.
        if nargs:
            snap = _string_at(args, 32 * nargs)
            result = entry[0](store, *[lift(snap, at) for lift, at in zip(sig.lift_params, range(0, 32 * nargs, 32))])
        else:
            result = entry[0](store)
        if sig.result is not None:
            buf = bytearray(32)
            fix: list = []
            sig.lower_result(result, buf, 0, fix)
            if sig.result_flat:
                # No pointer in it: the value as it is.
                _memmove(results, bytes(buf), 32)
            else:
                # The C API frees the result: a deep copy into its allocations. Always, even with no
                # fixups: a value may point outside this buffer (a variant case's name in its type's
                # `_Names`, a `Lowered` arena), memory the C API must not own.
                _pinned, base = _relocate(buf, fix)
                _clone_at(base, results)

    return catch_exceptions(context, run)


@_finalizer_t
def _import_finalize(idx):  # type: ignore[no-untyped-def]
    _IMPORTS.pop(idx or 0, None)


def _add_import(instance: Any, name: str, func: Callable[..., Any]) -> None:
    """`LinkerInstance.add_func`, with the import's types asked once."""
    idx = _next_import[0]
    _next_import[0] += 1
    _IMPORTS[idx] = [func, None]
    name_bytes = name.encode("utf-8")
    err_ = _linker_add_func(instance.ptr(), name_bytes, len(name_bytes), _import_impl, idx, _import_finalize)
    if err_:
        raise wasmtime.WasmtimeError._from_ptr(err_)


# ------------------------------------------------------------ values


_WIT_NAMES: dict[str, str] = {}


def record(**fields: Any) -> Record:
    """A component record; Python names map to WIT names (`_` is `-`)."""
    r = Record()
    d = r.__dict__
    names = _WIT_NAMES
    for name, value in fields.items():
        wit = names.get(name)
        if wit is None:
            wit = names[name] = name.replace("_", "-")
        d[wit] = value
    return r


def get(r: Any, name: str) -> Any:
    """A field of a component record by its WIT name."""
    return getattr(r, name)


def response_in(r: Any, what: str = "response") -> Optional[Record]:
    """A response (``idem.Response``: status, headers, body) as the
    component's `stored-response`, or None."""
    if r is None:
        return None
    if not isinstance(r.status, int) or not 100 <= r.status <= 599:
        raise ValueError(f"{what}.status must be an integer from 100 to 599, got {r.status!r}")
    return record(status=r.status, headers=[(str(n), bytes(v)) for n, v in r.headers], body=bytes(r.body))


def success_in(result_ref: Optional[str], response: Any, what: str = "response") -> Record:
    """A success as the component's `success` record: `complete`'s argument,
    and the result a lookup found (`found_in`). ``what`` names the response
    in errors."""
    return record(result_ref=result_ref, response=response_in(response, what))


def found_in(found: Any) -> Optional[Record]:
    """What ``results.find_result(key)`` answered, as `option<success>`:
    None (surely no result) is none; a str is a success with that result
    reference; an ``idem.Success`` (``result_ref``, ``response``) is that
    success and an ``idem.Response`` a success with that response, both
    converted as `complete`'s (`success_in`). Anything else, or a response
    that breaks complete's rules, raises: the lookup failed."""
    if found is None:
        return None
    if isinstance(found, str):
        return success_in(found, None)
    if hasattr(found, "result_ref") and hasattr(found, "response"):
        return success_in(found.result_ref, found.response, "find_result().response")
    if hasattr(found, "status") and hasattr(found, "headers") and hasattr(found, "body"):
        return success_in(None, found, "find_result()")
    raise TypeError(f"find_result must return None, a str, a Success or a Response, got {type(found).__name__}")


def ok(value: Any) -> Variant:
    return Variant("ok", value)


def err(kind: str, message: str) -> Variant:
    return Variant("err", Variant(kind, message))


class StoreError(Exception):
    """A store failure, as `store-error` in wit/store.wit: `kind` is
    `unavailable`, `rejected` or `internal`."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"store {kind}: {message}")
        self.kind = kind
        self.message = message


class EngineError(Exception):
    """Why the engine could not decide (`engine-error`): `kind` is `store`,
    `corrupt` or `invalid`. A store failure is never read as "no record"."""

    def __init__(self, kind: str, message: str, store_kind: str | None = None,
                 field: str | None = None, rule: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.store_kind = store_kind
        self.field = field
        self.rule = rule


def engine_error(e: Any) -> EngineError:
    # engine-error is untagged in wasmtime-py: a Variant is `store`, a str
    # is `corrupt`, a record is `invalid`.
    if isinstance(e, Variant):
        return EngineError("store", f"the store failed ({e.tag}): {e.payload}", store_kind=e.tag)
    if isinstance(e, str):
        return EngineError("corrupt", f"a stored record is corrupt: {e}")
    return EngineError("invalid", f"invalid input: {e.message} (field {e.field}, rule {e.rule})", field=e.field, rule=e.rule)


def unwrap(result: Any) -> Any:
    """The ok value of an export's result; the err value raises EngineError."""
    if not isinstance(result, Variant) or result.tag not in ("ok", "err"):
        raise TypeError(f"expected a result, got {result!r}")
    if result.tag == "err":
        raise engine_error(result.payload)
    return result.payload


def _guarded(op: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """A store import: a StoreError becomes the `err` case, any other
    exception an `internal` one (never "no record")."""

    def call(_store: Any, *args: Any) -> Variant:
        try:
            return ok(f(*args))
        except StoreError as e:
            return err(e.kind, e.message)
        except Exception as e:  # noqa: BLE001 - reported to the engine as internal
            return err("internal", f"{op}: {type(e).__name__}: {e}")

    return call


# ------------------------------------------------------------ the component

_lock = threading.Lock()
_runtimes: dict[str, "Runtime"] = {}


def default_wasm_path() -> Path:
    """The component this package ships (package data)."""
    return Path(str(resources.files("idem").joinpath("idem_guest.wasm")))


class Runtime:
    """One Wasmtime engine and the compiled component, shared by every
    engine instance of the process."""

    def __init__(self, wasm_path: Path):
        self.path = wasm_path
        self.engine = wasmtime.Engine()
        self.component = Component.from_file(self.engine, str(wasm_path))

    @staticmethod
    def get(wasm_path: Path | str | None = None) -> "Runtime":
        path = Path(wasm_path) if wasm_path is not None else default_wasm_path()
        key = str(path.resolve())
        with _lock:
            rt = _runtimes.get(key)
            if rt is None:
                rt = Runtime(path)
                _runtimes[key] = rt
            return rt

    def linker(self, store: Any, clock: Any, results: Any) -> Linker:
        """A linker whose imports call `store` (insert_if_absent, get,
        compare_and_swap, delete_expired, list_stale(biz_type, now, after,
        limit), where `after` is None or a `stale-cursor` record, in the
        component's values), `clock` (now() -> int, pause(ms)) and `results`
        (find_result(key) -> None | str | Success | Response, read by
        `found_in`)."""
        linker = Linker(self.engine)
        with linker.root() as root:
            with root.add_instance(PACKAGE.format("store")) as s:
                _add_import(s, "insert-if-absent", _guarded("insert-if-absent", lambda c: store.insert_if_absent(c)))
                _add_import(s, "get", _guarded("get", lambda k: store.get(k)))
                _add_import(s, "compare-and-swap", _guarded("compare-and-swap", lambda rev, r: store.compare_and_swap(rev, r)))
                _add_import(s, "delete-expired", _guarded("delete-expired", lambda now, limit: store.delete_expired(now, limit)))
                _add_import(s, "list-stale", _guarded("list-stale", lambda b, now, after, limit: store.list_stale(b, now, after, limit)))
            with root.add_instance(PACKAGE.format("clock")) as c:
                _add_import(c, "now", lambda _s: int(clock.now()))
                _add_import(c, "pause", lambda _s, d: clock.pause(d))
            with root.add_instance(PACKAGE.format("results")) as r:
                _add_import(r, "find-result", _guarded("find-result", lambda k: found_in(results.find_result(k))))
        return linker


class Exports:
    """The `engine` interface of one instance of the component, in its own
    Wasmtime store."""

    NAMES = ("begin", "complete", "fail", "extend", "reconcile", "sweep", "inspect")

    def __init__(self, runtime: Runtime, linker: Linker):
        self.store = wasmtime.Store(runtime.engine)
        instance = linker.instantiate(self.store, runtime.component)
        iface = instance.get_export_index(self.store, PACKAGE.format("engine"))
        self.funcs = {}
        for name in self.NAMES:
            index = instance.get_export_index(self.store, name, iface)
            f = instance.get_func(self.store, index)
            self.funcs[name] = (f, _Signature(f.type(self.store)))
        # complete(ticket, policy, ...): the policy record's type.
        self._policy_type = self.funcs["complete"][1].params[1]
        self._policies: dict[str, Lowered] = {}

    def policy(self, policy: dict[str, Any] | None) -> Any:
        """`wit_policy(policy)` lowered once per distinct policy (see
        `Lowered`): a policy is the largest argument of most calls and is
        usually the same on every call. The key is the policy's JSON text,
        so a dict changed after a call is looked up again; a policy that
        is not plain JSON is converted on every call."""
        try:
            key = "null" if policy is None else json.dumps(policy, sort_keys=True)
        except (TypeError, ValueError):
            return wit_policy(policy)
        lowered = self._policies.get(key)
        if lowered is None:
            if len(self._policies) >= 32:
                self._policies.clear()
            lowered = self._policies[key] = Lowered(self._policy_type, wit_policy(policy))
        return lowered

    def call(self, name: str, *args: Any) -> Any:
        """Calls an export and returns its raw result (a tagged Variant)."""
        f, sig = self.funcs[name]
        try:
            return _call_export(f, sig, self.store, args)
        finally:
            f.post_return(self.store)


# ------------------------------------------------------------ policy

DEFAULT_POLICY: dict[str, Any] = {
    "retention_ms": 86_400_000,
    "lease_ms": 60_000,
    "retry_after_ms": 1_000,
    "expired_lease": "take-over",
    "outcome_unknown": "manual",
    "failure_mode": "honor-disposition",
    "max_attempts": None,
    "in_progress": "reject",
    "fingerprint_fields": [],
    "key_format": {"min_length": 1, "max_length": 255, "charset": "printable-ascii"},
    "max_body_bytes": 1_048_576,
}
"""The Rust `Policy::default()`, in its field names."""

_ENUMS = {
    "expired_lease": ("take-over", "reconcile", "manual"),
    "outcome_unknown": ("take-over", "reconcile", "manual"),
    "failure_mode": ("honor-disposition", "always-final"),
    "charset": ("printable-ascii", "uuid", "token"),
}
_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1


def _uint(path: str, v: Any, top: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > top:
        raise ValueError(f"policy.{path} must be an integer from 0 to {top}, got {v!r}")
    return v


def _one_of(path: str, v: Any, allowed: tuple[str, ...]) -> str:
    if v not in allowed:
        raise ValueError(f"policy.{path} must be one of {', '.join(allowed)}, got {v!r}")
    return v


def merge_policy(policy: dict[str, Any] | None) -> dict[str, Any]:
    """`policy` (Rust field names) over the defaults; unknown fields refused."""
    policy = dict(policy or {})
    for k in policy:
        if k not in DEFAULT_POLICY:
            raise ValueError(f"policy.{k} is not a policy field (the fields are {', '.join(DEFAULT_POLICY)})")
    kf = dict(policy.get("key_format") or {})
    for k in kf:
        if k not in DEFAULT_POLICY["key_format"]:
            raise ValueError(f"policy.key_format.{k} is not a key_format field (min_length, max_length, charset)")
    out = {**DEFAULT_POLICY, **policy}
    out["key_format"] = {**DEFAULT_POLICY["key_format"], **kf}
    return out


def wit_policy(policy: dict[str, Any] | None) -> Record:
    """A policy in the Rust crate's field names (snake_case; enum values in
    kebab-case; `max_attempts` is None for no limit; `in_progress` is
    "reject" or {"wait": {"max_wait_ms", "poll_interval_ms"}}) as the
    component's record. Wrong types are refused naming the field and the
    rule; value ranges are the engine's to check."""
    p = merge_policy(policy)
    ip = p["in_progress"]
    if ip == "reject":
        in_progress = None  # in-progress-mode is untagged in wasmtime-py: None is `reject`.
    elif isinstance(ip, dict) and isinstance(ip.get("wait"), dict):
        w = ip["wait"]
        in_progress = record(max_wait_ms=_uint("in_progress.wait.max_wait_ms", w.get("max_wait_ms"), _U64),
                             poll_interval_ms=_uint("in_progress.wait.poll_interval_ms", w.get("poll_interval_ms"), _U64))
    else:
        raise ValueError(f'policy.in_progress must be "reject" or {{"wait": {{"max_wait_ms": .., "poll_interval_ms": ..}}}}, got {ip!r}')
    ff = p["fingerprint_fields"]
    if not isinstance(ff, (list, tuple)) or not all(isinstance(f, str) for f in ff):
        raise ValueError("policy.fingerprint_fields must be a list of strings (JSON Pointers)")
    kf = p["key_format"]
    return record(
        retention_ms=_uint("retention_ms", p["retention_ms"], _U64),
        lease_ms=_uint("lease_ms", p["lease_ms"], _U64),
        retry_after_ms=_uint("retry_after_ms", p["retry_after_ms"], _U64),
        expired_lease=_one_of("expired_lease", p["expired_lease"], _ENUMS["expired_lease"]),
        outcome_unknown=_one_of("outcome_unknown", p["outcome_unknown"], _ENUMS["outcome_unknown"]),
        failure_mode=_one_of("failure_mode", p["failure_mode"], _ENUMS["failure_mode"]),
        max_attempts=None if p["max_attempts"] is None else _uint("max_attempts", p["max_attempts"], _U32),
        in_progress=in_progress,
        fingerprint_fields=list(ff),
        key_format=record(min_length=_uint("key_format.min_length", kf["min_length"], _U32),
                          max_length=_uint("key_format.max_length", kf["max_length"], _U32),
                          charset=_one_of("key_format.charset", kf["charset"], _ENUMS["charset"])),
        max_body_bytes=_uint("max_body_bytes", p["max_body_bytes"], _U32),
    )
