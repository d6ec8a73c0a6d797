"""Writes a small transformer decoder (ONNX) with a dynamic sequence length.

Each layer is pre-norm: LayerNormalization, causal multi-head self-attention
(MatMul, Softmax, Add of a causal bias), a residual Add, LayerNormalization,
a ReLU feed-forward (MatMul, Add) and a residual Add. Input "x" is
[1, seq, d_model] float32 with seq symbolic, output "y" the same shape.
Weights are seeded random (numpy), so the file is the same on every run.

    python make_decoder.py OUT.onnx [--layers 2 --d-model 512 --heads 8 --ffn 2048]
"""

import argparse

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build(layers, d_model, heads, ffn, seed):
    assert d_model % heads == 0
    head_dim = d_model // heads
    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def const(name, array):
        inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(name, shape, scale):
        return const(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def node(op, inputs, name, **attrs):
        nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    # Causal bias [seq, seq]: 0 on and below the diagonal, -1e9 above,
    # computed from the input's shape so that it follows seq.
    shape = node("Shape", ["x"], "x_shape")
    seq = node("Slice", [shape, const("one_i64", np.array([1])), const("two_i64", np.array([2]))], "seq")
    square = node("Concat", [seq, seq], "seq_seq", axis=0)
    ones = node("ConstantOfShape", [square], "ones",
                value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]))
    lower = node("Trilu", [ones], "lower", upper=0)
    shifted = node("Sub", [lower, const("one_f", np.array(1.0, np.float32))], "lower_minus_one")
    bias = node("Mul", [shifted, const("big", np.array(1e9, np.float32))], "causal_bias")

    split_heads = const("split_heads", np.array([0, -1, heads, head_dim], np.int64))
    merge_heads = const("merge_heads", np.array([0, -1, d_model], np.int64))
    scale = const("scale", np.array(1.0 / np.sqrt(head_dim), np.float32))
    w_scale = 1.0 / np.sqrt(d_model)

    h = "x"
    for i in range(layers):
        p = f"l{i}_"
        ln1 = node("LayerNormalization",
                   [h, const(p + "ln1_g", np.ones(d_model, np.float32)),
                    const(p + "ln1_b", np.zeros(d_model, np.float32))],
                   p + "ln1", axis=-1, epsilon=1e-5)
        heads_of = {}
        for proj, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
            m = node("MatMul", [ln1, weight(p + "w" + proj, (d_model, d_model), w_scale)], p + proj)
            r = node("Reshape", [m, split_heads], p + proj + "_heads")
            heads_of[proj] = node("Transpose", [r], p + proj + "_t", perm=perm)
        scores = node("MatMul", [heads_of["q"], heads_of["k"]], p + "scores")
        scaled = node("Mul", [scores, scale], p + "scaled")
        masked = node("Add", [scaled, bias], p + "masked")
        probs = node("Softmax", [masked], p + "probs", axis=-1)
        ctx = node("MatMul", [probs, heads_of["v"]], p + "ctx")
        ctx_t = node("Transpose", [ctx], p + "ctx_t", perm=[0, 2, 1, 3])
        merged = node("Reshape", [ctx_t, merge_heads], p + "ctx_merged")
        attn = node("MatMul", [merged, weight(p + "wo", (d_model, d_model), w_scale)], p + "attn")
        h1 = node("Add", [h, attn], p + "resid1")
        ln2 = node("LayerNormalization",
                   [h1, const(p + "ln2_g", np.ones(d_model, np.float32)),
                    const(p + "ln2_b", np.zeros(d_model, np.float32))],
                   p + "ln2", axis=-1, epsilon=1e-5)
        up = node("MatMul", [ln2, weight(p + "w1", (d_model, ffn), w_scale)], p + "up")
        up_b = node("Add", [up, weight(p + "b1", (ffn,), 0.02)], p + "up_b")
        act = node("Relu", [up_b], p + "act")
        down = node("MatMul", [act, weight(p + "w2", (ffn, d_model), 1.0 / np.sqrt(ffn))], p + "down")
        down_b = node("Add", [down, weight(p + "b2", (d_model,), 0.02)], p + "down_b")
        h = node("Add", [h1, down_b], p + "out")
    nodes.append(helper.make_node("Identity", [h], ["y"], name="y"))

    io_shape = [1, "seq", d_model]
    graph = helper.make_graph(
        nodes, "decoder",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, io_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, io_shape)],
        initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="vmm-arena make_decoder.py")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=20261203)
    args = ap.parse_args()
    model = build(args.layers, args.d_model, args.heads, args.ffn, args.seed)
    onnx.save(model, args.out)


if __name__ == "__main__":
    main()
