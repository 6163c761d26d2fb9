"""The model of train_gpt.py: its parameters and scalars, the loss at initialization, a gradient path to every
parameter, the gradients added into fixed buffers, the fused MLP backward, and one graph for torch.compile."""

import math

import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg
from conftest import TINY_BOS, TINY_VOCAB, random_documents, record_model, tiny_hyperparameters, tiny_model


def test_record_parameter_inventory():
    model = record_model()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["embed.weight"] == (50304, 768) and shapes["lm_head.weight"] == (50304, 768) and shapes["scalars"] == (72,)
    assert (
        shapes["blocks.1.attn.qkvo_w"] == (768, 3072)
        and shapes["blocks.1.mlp.c_fc"] == (768, 3072)
        and shapes["blocks.1.attn.attn_gate.weight"] == (6, 12)
    )
    assert not any(n.startswith("blocks.0.") for n in shapes) and "blocks.7.attn.qkvo_w" not in shapes and "blocks.7.mlp.c_fc" in shapes
    count = lambda tag: sum(p.numel() for p in model.parameters() if p.module_tag == tag)
    assert (count("attn"), count("mlp"), count("attn_gate") + count("smear_gate")) == (23_592_960, 51_904_512, 732)
    assert tg.embedding_parameter_count(model) == 154_533_888
    assert tg.matmul_parameter_count(model) == 23_592_960 + 51_904_512 + 38_633_472
    assert (
        model.embed.weight.lr_mul == 75
        and model.value_embeds[2].weight.lr_mul == 75
        and model.scalars.lr_mul == 5
        and model.lm_head.weight.lr_mul == 1
    )


def test_scalar_views_name_the_record_layout():
    """Checkpoints and DistAdam's shards see one vector: the views must keep its order and initial values."""
    views = tg.Scalars.of(torch.arange(72.0))
    assert views.skip_gates.tolist() == list(range(12))
    assert views.block_lambdas.tolist() == [[12 + 2 * i, 13 + 2 * i] for i in range(12)]
    assert views.value_mixing.tolist() == [[36 + 2 * i, 37 + 2 * i] for i in range(12)]
    assert views.smear_lambda.item() == 60
    initial = tg.Scalars.initial(world_size=1)
    assert initial.tolist() == [-1.5] * 12 + [1.0, 0.0] * 12 + [0.5, 0.5] * 12 + [0.0] * 12
    assert [tg.Scalars.initial(n).numel() for n in (1, 2, 4, 5, 8)] == [72, 72, 72, 75, 72]  # padded to the world size
    assert tg.Scalars.of(initial).block_lambdas.data_ptr() == initial.data_ptr() + 12 * initial.element_size()  # views



@pytest.mark.parametrize("world_size", [1, 5])
def test_reset_parameters_gives_every_parameter_its_fresh_value(world_size: int) -> None:
    """bench/ab.py starts each round with manual_seed(round) and reset_parameters(); a parameter the reset forgot
    (the scalars once) would carry the previous round's training into the next."""
    def built() -> tg.GPT:
        return tg.GPT(TINY_VOCAB, 64, 2, 256, 16, world_size, tg.attention_backend("reference", 16, TINY_BOS), torch.float32)

    trained, fresh = built(), built()
    with torch.no_grad():
        for param in trained.parameters():  # every value moved, as a round of training moves them
            param.add_(torch.rand_like(param) + 0.5)
    for model in (trained, fresh):
        torch.manual_seed(7)
        model.reset_parameters()
    for (name, a), b in zip(trained.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(fresh.scalars, tg.Scalars.initial(world_size))


def test_initial_loss_is_uniform_over_the_padded_vocabulary():
    model = tiny_model().eval()
    ids = torch.randint(0, TINY_VOCAB, (128,), dtype=torch.int32)
    loss = model(ids, ids.long(), None, 1, 3, 128)
    assert loss.item() == pytest.approx(math.log(512), abs=1e-5)
    model.train()
    assert model(ids, ids.long(), None, 1, 3, 128).item() == pytest.approx(128 * math.log(512), rel=1e-5)  # sum in training


def test_every_parameter_gets_a_gradient_path_after_two_updates():
    model = tiny_model()
    ids = torch.randint(0, TINY_VOCAB - 1, (128,), dtype=torch.int32)
    ids[::37] = TINY_BOS
    hp = tiny_hyperparameters()
    adam, muon = tg.build_optimizers(model, hp, 0, 1)
    for _ in range(2):  # zero-initialized matrices (O, c_proj, head) only pass gradient after a first step
        model(ids, ids.long(), None, 1, 3, 128).backward()
        adam.step()
        muon.step()
    model(ids, ids.long(), None, 1, 3, 128).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == [], missing
    used = tg.Scalars.of(model.scalars.grad != 0)  # which scalars the forward reads
    assert used.skip_gates.tolist() == [True] * 5 + [False] * 7
    assert used.block_lambdas.tolist() == [[False, False]] + [[True, True]] * 11  # layer 0 never runs
    attention_layers = [layer not in tg.ATTENTION_LAYERS_SKIPPED for layer in range(12)]
    assert used.value_mixing[:, 0].tolist() == attention_layers  # s0 in every attention layer
    assert used.value_mixing[:, 1].tolist() == [ve is not None for ve in tg.VALUE_EMBED_FOR_LAYER]  # s1 with a value embedding
    assert used.smear_lambda and not (model.scalars.grad[61:] != 0).any()


def test_in_place_table_gradients_equal_autograds_through_three_updates():
    """GPT.grads_into_buffers of the tables (as build_model sets it up) against autograd's embedding backward and
    AccumulateGrad: every gradient after three micro-steps and every weight after three Adam + Muon steps, bit for
    bit; the tables' .grad are the buffers, and checkpoints do not see them."""
    plain, in_place = tiny_model(), tiny_model()
    in_place.grads_into_buffers(table.weight for table in in_place.tables)
    assert in_place.state_dict().keys() == plain.state_dict().keys()
    hp = tiny_hyperparameters()
    optimizers = [tg.build_optimizers(model, hp, 0, 1) for model in (plain, in_place)]
    torch.manual_seed(1)
    for step in range(3):  # zero-initialized matrices pass the tables no gradient before two updates
        for _ in range(3):
            ids = torch.randint(0, TINY_VOCAB - 1, (128,), dtype=torch.int32)
            ids[::37] = TINY_BOS
            for model in (plain, in_place):
                model(ids, ids.long(), None, 1, 3, 128).backward()
        assert all(table.weight.grad is table.weight_grad for table in in_place.tables)
        for (name, p), q in zip(plain.named_parameters(), in_place.parameters()):
            assert torch.equal(p.grad, q.grad), name
        assert step < 2 or all(table.weight.grad.abs().sum() > 0 for table in in_place.tables)
        for (model, (adam, muon)) in zip((plain, in_place), optimizers):
            adam.step()
            muon.step()
            model.zero_grad()
        assert in_place.embed.weight.grad is not None and not in_place.embed.weight.grad.any()
    for (name, p), q in zip(plain.named_parameters(), in_place.parameters()):
        assert torch.equal(p, q), name


def module_buffers(model: tg.GPT) -> list[torch.Tensor]:
    """The matrices' `<name>_grad` buffers, read from their modules (what the backward adds into)."""
    return [getattr(module, f"{name}_grad") for module in model.modules() for name in tg.MATRIX_NAMES.get(type(module), ())]


def in_cuda_dtypes(model: tg.GPT) -> tg.GPT:
    """build_model's dtypes on CUDA: tables and linears bf16 (so activations are bf16), matrices and scalars fp32."""
    for module in model.modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.Linear)):
            module.bfloat16()
    return model


@pytest.mark.parametrize("cuda_dtypes", [False, True])
def test_in_place_matrix_gradients_equal_autograds_through_three_updates(cuda_dtypes):
    """GPT.grads_into_buffers of the matrices (tables in place on both sides, as build_model sets them up) against autograd's cast
    backward and AccumulateGrad: every gradient after three micro-steps and every weight after three Adam + Muon
    steps, bit for bit, in fp32 and in CUDA's dtypes (bf16 activations, fp32 matrices); checkpoints do not see the
    buffers."""
    convert = in_cuda_dtypes if cuda_dtypes else (lambda model: model)
    plain, in_place = convert(tiny_model()), convert(tiny_model())
    for model in (plain, in_place):  # the tables' sums as inductor computes them on both sides (not eager bf16's)
        model.grads_into_buffers(table.weight for table in model.tables)
    in_place.grads_into_buffers(in_place.matrices())
    assert in_place.state_dict().keys() == plain.state_dict().keys()
    matrices = in_place.matrices()
    assert len(matrices) == 10 + 11 * 2 and all(m.dtype == torch.float32 for m in matrices)
    hp = tiny_hyperparameters()
    optimizers = [tg.build_optimizers(model, hp, 0, 1) for model in (plain, in_place)]
    torch.manual_seed(1)
    for step in range(3):
        for _ in range(3):
            ids = torch.randint(0, TINY_VOCAB - 1, (128,), dtype=torch.int32)
            ids[::37] = TINY_BOS
            for model in (plain, in_place):
                model(ids, ids.long(), None, 1, 3, 128).backward()
        buffered = [(p, tg.grad_buffer(p)) for p in in_place.parameters() if tg.grad_buffer(p) is not None]
        assert len(buffered) == 4 + 32 and all(p.grad is buffer for p, buffer in buffered)
        assert all(m.grad is m_module_buffer for m, m_module_buffer in zip(matrices, module_buffers(in_place)))
        for (name, p), q in zip(plain.named_parameters(), in_place.parameters()):
            assert torch.equal(p.grad, q.grad), name
        assert step < 2 or all(m.grad.abs().sum() > 0 for m in matrices)
        for (model, (adam, muon)) in zip((plain, in_place), optimizers):
            adam.step()
            muon.step()
            model.zero_grad()
        assert all(m.grad is not None and not m.grad.any() for m in matrices)
    for (name, p), q in zip(plain.named_parameters(), in_place.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("addend_dtype", [torch.bfloat16, torch.float32])
def test_add_into_grad_is_the_eager_sum(addend_dtype):
    """The CPU path (the eager formula itself); the kernel is checked under the interpreter and on CUDA."""
    grad = torch.randn(33, 70)
    addend = torch.randn(33, 70).to(addend_dtype)
    expected = grad + addend.float()
    tg.add_into_grad(grad, addend)
    assert torch.equal(grad, expected)
    transposed = torch.randn(70, 33).to(addend_dtype).T  # not contiguous: the eager formula
    expected = grad + transposed.float()
    tg.add_into_grad(grad, transposed)
    assert torch.equal(grad, expected)


@pytest.mark.parametrize("grad, addend", [(torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 8)), (torch.zeros(4, 8), torch.zeros(8, 4))])
def test_add_into_grad_refuses_other_dtypes_and_shapes(grad, addend):
    with pytest.raises(ValueError, match="add_into_grad: needs an fp32 grad and an addend of its shape"):
        tg.add_into_grad(grad, addend)


@pytest.mark.parametrize("shapes", [((10, 8), (10,), (6,)), ((10, 7), (10,), (6, 8)), ((2, 5, 8), (2, 4), (6, 8))])
def test_table_gradients_refuse_mismatched_shapes(shapes):
    grad_out, ids, grad = (torch.zeros(shape) for shape in shapes)
    with pytest.raises(ValueError, match="accumulate_table_grads: needs grad"):
        tg.accumulate_table_grads([grad_out], ids.long(), [grad])


def test_table_gradients_refuse_a_count_mismatch():
    with pytest.raises(ValueError, match="accumulate_table_grads: 2 lookup gradients for 1 tables"):
        tg.accumulate_table_grads([torch.zeros(4, 8)] * 2, torch.zeros(4, dtype=torch.long), [torch.zeros(6, 8)])



# ---- the whole model traces as one graph (what torch.compile(fullgraph=True) needs on the GPU) ----
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("backend, training", [("reference", True), ("flex", False)])
def test_model_traces_without_graph_breaks(backend, training):
    """Dynamo only (no code generation): fullgraph raises on any graph break. The FP8 head is on in training
    (CPU _scaled_mm); FlexAttention has no CPU backward, so its graph is traced in eval mode. FlexAttention
    takes windows and attn_scale as tensors: a window change plus a YaRN update must not recompile."""
    model = tiny_model(backend).train(training)
    model.lm_head.use_fp8 = training
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(model, dynamic=False, fullgraph=True, backend=counting_backend)
    ids = random_documents(128, num_bos=4, seed=5).to(torch.int32)
    with torch.set_grad_enabled(training):
        for short, long in ((1, 3), (3, 7)):
            if long == 7:
                model.rotary.apply_yarn(3, 7)
            loss = compiled(ids, ids.long(), None, *model.attention.window_args(short, long, ids.device), 128)
            if training:
                loss.backward()
            assert torch.isfinite(loss)
    assert len(graphs) == (1 if backend == "flex" else 2)  # ints and a float attn_scale specialize, as in the record


def _unfused_mlp(x: torch.Tensor, c_fc: torch.Tensor, c_proj: torch.Tensor) -> torch.Tensor:
    """MLP.forward before its backward was fused: autograd differentiates every op."""
    return F.linear(F.relu(x @ c_fc.type_as(x)).square(), c_proj.type_as(x))


@pytest.mark.parametrize("kernel", ["triton", "quack"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mlp_with_the_fused_kernels_is_autograd_bitwise(dtype: torch.dtype, kernel: str) -> None:
    """ReLUSquaredMLP's output and the gradients of x and both weights against autograd of the unfused MLP,
    with pre-activations that are exactly 0 (relu's threshold) and a gradient that is not contiguous. On CPU both
    kernels' wrappers run the eager formula (the quack path without importing quack); tests/test_train_gpt_cuda.py
    runs the kernels."""
    torch.manual_seed(4)
    mlp = tg.MLP(64, kernel)
    with torch.no_grad():
        mlp.c_fc.copy_(torch.randn(64, 256) * 0.1)
        mlp.c_proj.copy_(torch.randn(64, 256) * 0.1)
        mlp.c_fc[:, :4] = 0.0  # pre = 0 in four columns
    x = torch.randn(1, 96, 64).to(dtype).requires_grad_()
    grad_out = torch.randn(1, 64, 96).to(dtype).transpose(1, 2)  # not contiguous
    out = mlp(x)
    out.backward(grad_out)
    got = (out.detach(), x.grad, mlp.c_fc.grad, mlp.c_proj.grad)
    x_ref = x.detach().clone().requires_grad_()
    c_fc, c_proj = (p.detach().clone().requires_grad_() for p in (mlp.c_fc, mlp.c_proj))
    want_out = _unfused_mlp(x_ref, c_fc, c_proj)
    want_out.backward(grad_out)
    want = (want_out.detach(), x_ref.grad, c_fc.grad, c_proj.grad)
    for name, g, w in zip(("out", "grad x", "grad c_fc", "grad c_proj"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), name
    assert int((x @ mlp.c_fc.type_as(x) <= 0).sum()) > 0 and int((x @ mlp.c_fc.type_as(x) > 0).sum()) > 0


@pytest.mark.parametrize("needs", [(True, True, True), (True, False, False), (False, True, False), (False, False, True)])
def test_relu_squared_mlp_at_zero_and_nan_pre_activations_and_partial_needs(needs: tuple[bool, bool, bool]) -> None:
    """Pre-activations holding 0 (a zero column of w_fc) and NaN (a NaN in x), against autograd of the formula, signs
    of zeros included; an input that needs no gradient gets none. (-0 cannot come out of x @ w_fc: the kernel's
    tests in tests/test_train_gpt_triton.py give it pre directly.)"""
    torch.manual_seed(5)
    x = torch.randn(2, 40, 16).bfloat16()
    x[1, 3, 5] = float("nan")
    w_fc = (torch.randn(16, 32) * 0.3).bfloat16()
    w_fc[:, :2] = 0.0
    w_proj = (torch.randn(16, 32) * 0.1).bfloat16()
    grad_out = torch.randn(2, 40, 16).bfloat16()
    leaves = [t.clone().requires_grad_(need) for t, need in zip((x, w_fc, w_proj), needs)]
    refs = [t.clone().requires_grad_(need) for t, need in zip((x, w_fc, w_proj), needs)]
    tg.ReLUSquaredMLP.apply(*leaves, "triton").backward(grad_out)
    F.linear(F.relu(refs[0] @ refs[1]).square(), refs[2]).backward(grad_out)
    for leaf, ref, needed in zip(leaves, refs, needs):
        assert (leaf.grad is None) == (not needed)
        if needed:
            assert torch.equal(leaf.grad.isnan(), ref.grad.isnan()) and torch.equal(leaf.grad.nan_to_num(), ref.grad.nan_to_num())
            assert torch.equal(leaf.grad.signbit(), ref.grad.signbit())  # -0 and +0 as autograd gives them


@pytest.mark.parametrize("kernel", ["triton", "quack"])
def test_relu2_matmuls_refuse_mismatched_operands(kernel: str) -> None:
    forward, backward = tg.RELU2_MATMULS[kernel]
    with pytest.raises(ValueError, match=f"{backward.__name__}: needs 2-D grad_out"):
        backward(torch.zeros(1, 4, 8), torch.zeros(8, 16), torch.zeros(4, 16))
    with pytest.raises(ValueError, match=r"needs grad_out \(M, K\), w \(K, N\), pre \(M, N\) of one dtype"):
        backward(torch.zeros(4, 8), torch.zeros(8, 16), torch.zeros(4, 12))
    with pytest.raises(ValueError, match="of one dtype"):
        backward(torch.zeros(4, 8), torch.zeros(8, 16), torch.zeros(4, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=f"{forward.__name__}: needs 2-D x .*: flatten the leading dimensions"):
        forward(torch.zeros(1, 4, 8), torch.zeros(8, 16))
    for w in (torch.zeros(6, 16), torch.zeros(8, 16).half()):
        with pytest.raises(ValueError, match=rf"{forward.__name__}: needs x \(M, K\) and w \(K, N\) of one dtype, got \(4, 8\)"):
            forward(torch.zeros(4, 8), w)


def test_mlp_saves_what_the_unfused_mlp_saved() -> None:
    """Peak memory: the fused backward saves the pre-activation and h (bf16 each) where autograd's unfused MLP saves
    relu(pre) and h: the same activation bytes per layer. (Compiled, inductor's partition of the joint graph
    saves the same two in both, which a CPU run of aot_autograd's min-cut partitioner showed (bench/NOTES.md, 2026-12-02, commit b1e22df).)"""
    mlp = tg.MLP(64)
    x = torch.randn(1, 96, 64).bfloat16().requires_grad_()
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    def activation_bytes(fn) -> int:
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        hidden = {t.untyped_storage().data_ptr(): t for t in saved if t.numel() == 96 * 256}  # one per storage
        return sum(t.numel() * t.element_size() for t in hidden.values())

    fused = activation_bytes(lambda: mlp(x))
    unfused = activation_bytes(lambda: _unfused_mlp(x, mlp.c_fc, mlp.c_proj))
    assert fused == unfused == 2 * 96 * 256 * 2


def test_compiled_partition_of_the_mlp_saves_the_unfused_mlps_bytes() -> None:
    """Peak memory as training compiles it: aot_autograd's min-cut partition of norm + MLP + residual keeps as many
    bytes between forward and backward with ReLUSquaredMLP as with autograd's unfused MLP (the forward graph's
    outputs: the result and what the backward needs; x is saved either way, for the gradient of w_fc)."""
    from torch._functorch.aot_autograd import aot_function, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def forward_output_bytes(mlp) -> int:
        kept: list[int] = []

        def forward_compiler(graph_module: torch.fx.GraphModule, _inputs: list) -> object:
            (outputs,) = [node.args[0] for node in graph_module.graph.nodes if node.op == "output"]
            kept.extend(node.meta["val"].numel() * node.meta["val"].element_size() for node in outputs)
            return make_boxed_func(graph_module.forward)

        step = aot_function(lambda r, c_fc, c_proj: r + mlp(F.rms_norm(r, (64,)), c_fc, c_proj), fw_compiler=forward_compiler,
                            bw_compiler=lambda graph_module, _inputs: make_boxed_func(graph_module.forward),
                            partition_fn=min_cut_rematerialization_partition)
        torch.manual_seed(6)
        leaves = [torch.randn(shape, dtype=torch.bfloat16, requires_grad=True) for shape in ((1, 96, 64), (64, 256), (64, 256))]
        step(*leaves).sum().backward()
        return sum(kept)

    fused = forward_output_bytes(lambda x, c_fc, c_proj: tg.ReLUSquaredMLP.apply(x, c_fc, c_proj, "triton"))
    unfused = forward_output_bytes(lambda x, c_fc, c_proj: F.linear(F.relu(x @ c_fc).square(), c_proj))
    assert fused == unfused >= 2 * 96 * 256 * 2  # at least pre (or relu(pre)) and h


def test_gradient_buffers_survive_every_zero_grad_and_a_move_of_the_model():
    """The optimizers' zero_grad and the model's keep the buffers attached, zeroed; after a move of the model (which
    replaces its buffers) the next zero_grad attaches the new ones, which the backward fills."""
    model = tiny_model()
    model.grads_into_buffers([*(table.weight for table in model.tables), *model.matrices()])
    hp = tiny_hyperparameters()
    adam, muon = tg.build_optimizers(model, hp, 0, 1)
    ids = random_documents(128, num_bos=4, seed=3).to(torch.int32)
    for zero_grad in (adam.zero_grad, muon.zero_grad, model.zero_grad):
        model(ids, ids.long(), None, 1, 3, 128).backward()
        zero_grad()
        for param in (model.embed.weight, model.blocks[1].attn.qkvo_w):
            assert param.grad is tg.grad_buffer(param) and not param.grad.any()
    model._apply(lambda t: t.clone())  # what .to(device or dtype) does to the buffers: new tensors
    model.zero_grad()
    with torch.no_grad():  # the zero-initialized head and output projections would pass the tables no gradient
        for param in model.parameters():
            param.add_(torch.randn_like(param), alpha=0.05)
    model(ids, ids.long(), None, 1, 3, 128).backward()
    for param in (model.embed.weight, model.blocks[1].attn.qkvo_w):
        module_buffer = tg.grad_buffer(param)
        assert param.grad is module_buffer and module_buffer.abs().sum() > 0
