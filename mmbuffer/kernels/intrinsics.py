"""LLVM-level helpers the compiled kernels share: a checked-by-caller ``memcpy``, the
address of an array, a typed pointer from an address (for ``numba.carray`` over
memory that numba did not allocate: mapped files, buffers of a C library), and a
read prefetch.

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

__all__ = ["address", "memcpy", "pointer", "pointer64", "prefetch"]


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


def _prefetch_typing(typingctx: Any, arr: Any, i: Any) -> Any:
    """A read prefetch of the cache line holding element ``i`` of the 1-D array ``arr``
    (any stride: a column of a 2-D array too). A hint: it never faults, so an index
    past the end is harmless."""
    if arr.ndim != 1:
        return None
    sig = types.void(arr, types.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        a, i = args
        proxy = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=a)
        stride = cgutils.unpack_tuple(builder, proxy.strides, 1)[0]
        byte = ir.IntType(8).as_pointer()
        ptr = builder.gep(builder.bitcast(proxy.data, byte), [builder.mul(i, stride)])
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [byte, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])  # read, keep in all cache levels, data
        return context.get_dummy_value()

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
prefetch: Any = intrinsic(_prefetch_typing)
