"""Writes a GGUF whose every tensor is the float32 dequantization of another GGUF's.

llama.cpp multiplies a quantized matrix by activations quantized to 8 bits; a float32 GGUF
of the same dequantized values makes it compute in float32, as ninfer-perplexity's f32
artifact does, so the two differ only in arithmetic order. Usage:
    python gguf_to_f32.py SRC.gguf DST.gguf
Metadata (tokenizer, hyperparameters) is copied as it is.
"""
import sys, numpy as np, gguf
src, dst = sys.argv[1:]
r = gguf.GGUFReader(src)
arch = r.fields["general.architecture"]
w = gguf.GGUFWriter(dst, arch=bytes(arch.parts[arch.data[0]]).decode())
for name, f in r.fields.items():
    if name.startswith("GGUF.") or name == "general.architecture":
        continue
    t = f.types[0]
    if t == gguf.GGUFValueType.ARRAY:
        sub = f.types[1]
        if sub == gguf.GGUFValueType.STRING:
            v = [bytes(f.parts[i]).decode("utf-8", "surrogateescape") for i in f.data]
        else:
            v = [f.parts[i][0].item() for i in f.data]
        w.add_key_value(name, v, t, sub_type=sub)
    elif t == gguf.GGUFValueType.STRING:
        w.add_key_value(name, bytes(f.parts[f.data[0]]).decode(), t)
    else:
        w.add_key_value(name, f.parts[f.data[0]][0].item(), t)
for t in r.tensors:
    a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    w.add_tensor(t.name, a)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
