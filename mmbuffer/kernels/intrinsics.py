"""LLVM-level helpers the compiled kernels share: a checked-by-caller ``memcpy``, the
address of an array, and a typed pointer from an address (for ``numba.carray`` over
memory that numba did not allocate: mapped files, buffers of a C library).

Each is a numba ``intrinsic``; they compile with the kernel that calls them (never at
import). Unchecked by design: every caller validates its ranges first.
"""

from __future__ import annotations

from typing import Any

from numba import types
from numba.core import cgutils as _cgutils
from numba.extending import intrinsic

cgutils: Any = _cgutils  # numba's code generation helpers are untyped
ir: Any = cgutils.ir  # llvmlite's IR builder, as numba imports it

__all__ = ["address", "memcpy", "pointer", "pointer64"]


def _memcpy_typing(typingctx: Any, dst: Any, dst_off: Any, src: Any, src_off: Any, nbytes: Any) -> Any:
    """``dst[dst_off : dst_off + nbytes] = src[src_off : ...]`` as one ``llvm.memcpy``
    (numba's slice assignment copies byte by byte: 2-10x slower on rows of a few KB)."""
    sig = types.void(dst, types.intp, src, types.intp, types.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        d, doff, s, soff, n = args
        dptr = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=d).data
        sptr = cgutils.create_struct_proxy(signature.args[2])(context, builder, value=s).data
        cgutils.raw_memcpy(builder, builder.gep(dptr, [doff]), builder.gep(sptr, [soff]), n, 1)
        return context.get_dummy_value()

    return sig, codegen


def _address_typing(typingctx: Any, arr: Any) -> Any:
    """The address of an array's first byte, as int64."""
    sig = types.int64(arr)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        data = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=args[0]).data
        return builder.ptrtoint(data, ir.IntType(64))

    return sig, codegen


def _pointer_of(kind: Any) -> Any:
    def typing(typingctx: Any, address: Any) -> Any:
        pointer: Any = types.CPointer  # untyped in numba's stubs
        sig = pointer(kind)(types.int64)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    return typing


memcpy: Any = intrinsic(_memcpy_typing)
address: Any = intrinsic(_address_typing)
pointer: Any = intrinsic(_pointer_of(types.uint8))  # the byte at an address, as uint8*
pointer64: Any = intrinsic(_pointer_of(types.int64))  # the int64 at an address, as int64*
