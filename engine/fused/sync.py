"""Synchronisation primitives of the fused decode step (engine/fused/kernel.py) and of the thread that
reads for it while it runs (driver.py): atomic loads and stores on int64 arrays, fences, the spin-wait
hint, sched_yield, an eventfd write and the cycle counter, as numba intrinsics; and the flag helpers the driver
calls between them.
"""

from __future__ import annotations

import platform

import llvmlite.ir as ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.kernels.simd import U64

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
LINE = 16        # int64 slots between two flags of `sync` and of `cur` (two cache lines)


def _int64_array(arr) -> bool:
    return isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1


@intrinsic
def atomic_load(typingctx, arr, idx):
    """arr[idx] read with acquire ordering (int64 array): what was written before the matching store is visible."""
    if not _int64_array(arr):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return builder.load_atomic(builder.gep(data, [args[1]]), "acquire", 8)
    return types.int64(arr, idx), codegen


@intrinsic
def atomic_store(typingctx, arr, idx, val):
    """arr[idx] = val with release ordering (int64 array): everything written before is visible with it."""
    if not _int64_array(arr):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        value = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store_atomic(value, builder.gep(data, [args[1]]), "release", 8)
        return context.get_dummy_value()
    return types.none(arr, idx, val), codegen


@intrinsic
def fence(typingctx):
    """A full memory barrier (sequentially consistent): stores before it are visible before loads after it."""
    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.none(), codegen


@intrinsic
def wake(typingctx, fd, arr):
    """write(fd, &arr[0], 8): one word to an eventfd (the driver's wake-up; int64 array holding a positive count)."""
    if not _int64_array(arr):
        return None

    def codegen(context, builder, sig, args):
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(32), i8p, ir.IntType(64)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "write")
        data = context.make_array(sig.args[1])(context, builder, args[1]).data
        fd32 = builder.trunc(context.cast(builder, args[0], sig.args[0], types.int64), ir.IntType(32))
        builder.call(fn, [fd32, builder.bitcast(data, i8p), ir.Constant(ir.IntType(64), 8)])
        return context.get_dummy_value()
    return types.none(fd, arr), codegen


@intrinsic
def yield_cpu(typingctx):
    """sched_yield(): let the reader and driver threads run (a thread waiting for a read on a busy core)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()
    return types.none(), codegen


@njit(cache=True)
def set_flag(flags, idx, value):  # pragma: no cover - compiled
    """flags[idx] = value for a running step to see (released after what was written before; fenced)."""
    atomic_store(flags, U64(idx), value)
    fence()


@njit(cache=True)
def in_use(cur, threads, layer):  # pragma: no cover - compiled
    """Whether a thread of a running step may be reading the streamed experts of `layer` (after set_flag)."""
    fence()
    for t in range(threads):
        if atomic_load(cur, U64(t * LINE)) == layer:
            return True
    return False


@intrinsic
def spin_pause(typingctx):
    """The CPU's spin-wait hint (x86 `pause`); nothing elsewhere."""
    def codegen(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.none(), codegen


@intrinsic
def cycles(typingctx):
    """The CPU's cycle counter (for splitting a step's wall time into phases)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []), "llvm.readcyclecounter")
        return builder.call(fn, [])
    return types.int64(), codegen
