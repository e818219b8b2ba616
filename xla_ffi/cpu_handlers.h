// The CPU FFI handler symbols exported to Python through bindings.cc.
#ifndef PIJ_XLA_FFI_CPU_HANDLERS_H_
#define PIJ_XLA_FFI_CPU_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(PijSparseFfnCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PijLinearCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PijLinearManyCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PijQ4ScoresCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PijQ4SparseFfnCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PijDecodeAttentionCpu);

#endif  // PIJ_XLA_FFI_CPU_HANDLERS_H_
