"""Copy a GGUF with edits (tests of bad files): tensors dropped, metadata keys dropped or set.
Read with the `gguf` package's GGUFReader, written with its GGUFWriter, every other key and
tensor as it was (types kept)."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def rewrite(src: Path, dst: Path, *, drop_tensors=(), drop_keys=(), set_keys=None) -> Path:
    import gguf

    set_keys = dict(set_keys or {})
    reader = gguf.GGUFReader(str(src))
    arch = set_keys.get("general.architecture",
                        reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in drop_keys or name == "general.architecture":
            continue
        vtype = field.types[0]
        value = set_keys.pop(name, field.contents())
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, value, gguf.GGUFValueType.STRING
                                 if isinstance(value, str) else vtype)
    for name, value in set_keys.items():
        if name == "general.architecture":
            continue
        if isinstance(value, list):
            writer.add_array(name, value)
        else:
            writer.add_string(name, str(value))
    for t in reader.tensors:
        if t.name in drop_tensors:
            continue
        data = np.asarray(t.data)
        # block-quantized data comes as bytes [rows, row bytes]: its shape is the byte shape the
        # writer takes with a quantized raw_dtype (it derives the element shape from it)
        writer.add_tensor(t.name, data, raw_shape=data.shape if data.dtype == np.uint8 else None,
                          raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
