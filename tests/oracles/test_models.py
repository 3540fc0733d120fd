"""remat on real architectures, against the same model and call without remat.

Models (tests/support/model_zoo.py): Hugging Face Llama, GPT-2 and BERT (SDPA and eager
attention), a timm-style ViT, torch's nn.TransformerEncoder (post- and pre-norm),
two static-shape mixture-of-experts layers, and torchvision's ResNet BasicBlock. All are
tiny, float64, random-init, in training mode with dropout on. The remat'd model is a
`copy.deepcopy` of the reference taken before `checkpoint_layers` changes it in place, so
both start from the same parameters; both runs are seeded identically.

Calling styles:
  backward     model(**batch) -> loss.backward(): loss, every .grad, every buffer
               (bitwise) and the global random stream afterwards; two steps, so the
               second runs from remat's cache.
  functional   torch.func.grad_and_value over functional_call's parameter dict.
  per-sample   vmap(grad(loss of one example), randomness="different").
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import model_zoo as Z
import optree
import pytest
import torch
from support.kept_memory import bytes_kept_for_backward
from torch.func import functional_call, grad, grad_and_value, vmap

import remat
from remat import RematError
from remat import policies as P
from remat._api.torch_style import _REGIONS

from conftest import BUILT_IN_POLICIES, assert_close

pytestmark = [
    pytest.mark.models,
    pytest.mark.filterwarnings("ignore::remat.RematPolicyWarning"),  # e.g. dots_and_attention on a conv block
]

MODEL_POLICIES = BUILT_IN_POLICIES
CASES = {case.name: case for case in Z.HF_CASES + Z.OWN_CASES}
SEED = 1234


def _transform_params(offset: int) -> list[tuple[str, str]]:
    """(case, policy) pairs for the torch.func styles, which cost a trace each (a second or
    more per transformers model on 2 cores). `backward` runs every policy on every model;
    here each transformers model gets one policy and each of our own models two, rotated
    so that each style still runs every policy on transformers models and on our own."""
    names = list(MODEL_POLICIES)
    pairs = [(case.name, names[(i + offset) % len(names)]) for i, case in enumerate(Z.HF_CASES)]
    for i, case in enumerate(Z.OWN_CASES):
        pairs += [(case.name, names[(2 * i + offset + j) % len(names)]) for j in range(2)]
    return pairs


@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread() -> Any:
    """These models are tiny: a second intra-op thread only adds synchronisation, which on
    a busy 2-core machine costs milliseconds per op (the file ran 5 minutes instead of 2).
    Remat and the reference run under the same setting; restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def _prototype(case_name: str) -> torch.nn.Module:
    """Each model is built once (building a transformers model costs seconds) and copied."""
    torch.manual_seed(0)
    return CASES[case_name].build()


def _pair(case: Z.Case, policy_name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(remat'd model, reference) with identical parameters and buffers."""
    reference = copy.deepcopy(_prototype(case.name))
    model = copy.deepcopy(reference)
    remat.checkpoint_layers(case.layers(model), MODEL_POLICIES[policy_name])
    return model, reference


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def _assert_rematerialized(case: Z.Case, model: torch.nn.Module, hits: int = 0) -> None:
    """The remat'd layers really ran through remat (traced, or took a like layer's plan, then
    `hits` calls from the cache)."""
    for layer in case.layers(model):
        info = layer.forward.cache_info()
        assert info["traces"] + info["like"] >= 1 and info["hits"] >= hits, info


def _assert_bitwise(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    differ = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert not differ, f"buffers differ from no remat: {differ}"


# ---------------------------------------------------------------- backward


def _backward_steps(case: Z.Case, model: torch.nn.Module, steps: int = 2) -> Any:
    batch = case.batch(Z.BATCH)
    losses = []
    torch.manual_seed(SEED)
    for _ in range(steps):
        loss = case.loss(model(**case.model_kwargs(batch)), batch)
        loss.backward()
        losses.append(loss.detach())
    after = torch.rand(4)  # where the global random stream is after forward and backward
    grads = {name: p.grad for name, p in model.named_parameters()}
    return losses, grads, _buffers(model), after


def _assert_steps_match(actual: Any, expected: Any) -> None:
    """`_backward_steps` of a remat'd model against its reference's: losses and gradients
    close, buffers bitwise, the random stream after the same."""
    (losses, grads, buffers, after), (ref_losses, ref_grads, ref_buffers, ref_after) = actual, expected
    assert_close(losses, ref_losses)
    assert_close(grads, ref_grads)
    _assert_bitwise(buffers, ref_buffers)
    assert torch.equal(after, ref_after), "global random stream differs from no remat after forward+backward"


@pytest.mark.parametrize("policy_name", list(MODEL_POLICIES))
@pytest.mark.parametrize("case_name", list(CASES))
def test_backward_matches_no_remat(case_name: str, policy_name: str) -> None:
    case = CASES[case_name]
    model, reference = _pair(case, policy_name)
    _assert_steps_match(_backward_steps(case, model), _backward_steps(case, reference))
    _assert_rematerialized(case, model, hits=1)


@pytest.mark.parametrize("policy_name", list(MODEL_POLICIES))
@pytest.mark.parametrize("case_name", [case.name for case in Z.REPLAYED_CASES])
def test_layers_remat_cannot_trace_train_as_without_remat(case_name: str, policy_name: str) -> None:
    """Bloom's custom GeLU Function, Mixtral's and Qwen3-MoE's eager experts (dropout and
    router jitter on): each layer runs replayed, saying why once, and two training steps
    equal no remat: losses, gradients, buffers and the random stream after."""
    case = next(c for c in Z.REPLAYED_CASES if c.name == case_name)
    torch.manual_seed(0)
    reference = case.build()
    model = copy.deepcopy(reference)
    remat.checkpoint_layers(case.layers(model), MODEL_POLICIES[policy_name])
    with pytest.warns(remat.RematFallbackWarning, match="GeLUFunction|aten.nonzero"):
        actual = _backward_steps(case, model)
    _assert_steps_match(actual, _backward_steps(case, reference))
    for layer in case.layers(model):
        assert layer.forward.cache_info()["replays"] == 2, layer.forward.cache_info()


@pytest.mark.parametrize("policy_name", ["nothing", "dots", "everything"])
@pytest.mark.parametrize("case_name", [case.name for case in Z.REPLAYED_CASES])
def test_a_report_of_a_layer_that_runs_replayed_says_what_its_backward_graph_holds(case_name: str, policy_name: str) -> None:
    """remat.report of each replayed layer, called as the model calls it: the values it
    keeps are, byte for byte, the memory its forward made that its backward graph holds
    (the garbage collector's count, which reads nothing of remat's); the same random draws
    in both, so that the routing, and with it every shape, is the same."""
    case = next(c for c in Z.REPLAYED_CASES if c.name == case_name)
    torch.manual_seed(0)
    model = case.build()
    layers = list(case.layers(model))
    calls: list[tuple[Any, ...]] = []
    handles = [layer.register_forward_pre_hook(lambda m, a, k: calls.append((m, a, k)), with_kwargs=True) for layer in layers]
    with torch.no_grad():
        model(**case.model_kwargs(case.batch(Z.BATCH)))
    for handle in handles:
        handle.remove()
    remat.checkpoint_layers(case.layers(model), MODEL_POLICIES[policy_name])
    for layer, args, kwargs in calls:

        def forward(layer: Any = layer, args: Any = args, kwargs: Any = kwargs) -> torch.Tensor:
            torch.manual_seed(1)
            out = layer(args[0].detach().requires_grad_(), *args[1:], **kwargs)
            return next(t for t in optree.tree_leaves(out) if isinstance(t, torch.Tensor))

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", remat.RematFallbackWarning)
            torch.manual_seed(1)
            found = remat.report(layer, *args, **kwargs)
            measured = bytes_kept_for_backward(forward)
        assert found.replayed == {layer.forward.region}
        assert sum(r.nbytes for r in found.residuals if r.kind == "intermediate") == measured, layer.forward.region
        assert (measured > 0) == (policy_name != "nothing")  # a policy that keeps: values kept


# ---------------------------------------------------------------- functional_call + grad


def _functional(case: Z.Case, model: torch.nn.Module) -> Any:
    batch = case.batch(Z.BATCH)

    def loss_fn(params: dict[str, torch.Tensor]) -> torch.Tensor:
        return case.loss(functional_call(model, params, (), case.model_kwargs(batch)), batch)

    torch.manual_seed(SEED)
    grads, loss = grad_and_value(loss_fn)(_params(model))
    return loss, grads, _buffers(model), torch.rand(4)


@pytest.mark.parametrize(("case_name", "policy_name"), _transform_params(0))
def test_functional_call_grad_matches_no_remat(case_name: str, policy_name: str) -> None:
    case = CASES[case_name]
    model, reference = _pair(case, policy_name)
    loss, grads, buffers, after = _functional(case, model)
    ref_loss, ref_grads, ref_buffers, ref_after = _functional(case, reference)
    assert_close((loss, grads), (ref_loss, ref_grads))
    _assert_bitwise(buffers, ref_buffers)
    assert torch.equal(after, ref_after), "global random stream differs from no remat"
    _assert_rematerialized(case, model)


# ---------------------------------------------------------------- per-sample gradients


def _per_sample(case: Z.Case, model: torch.nn.Module, examples: int = 3) -> Any:
    batch = case.examples(examples)

    def loss_one(params: dict[str, torch.Tensor], example: dict[str, torch.Tensor]) -> torch.Tensor:
        example = {k: v.unsqueeze(0) for k, v in example.items()}
        return case.loss(functional_call(model, params, (), case.model_kwargs(example)), example)

    torch.manual_seed(SEED)
    grads = vmap(grad(loss_one), in_dims=(None, 0), randomness="different")(_params(model), batch)
    return grads, torch.rand(4)


@pytest.mark.parametrize(("case_name", "policy_name"), _transform_params(3))
def test_per_sample_grads_match_no_remat(case_name: str, policy_name: str) -> None:
    case = CASES[case_name]
    model, reference = _pair(case, policy_name)
    try:
        expected = _per_sample(case, reference)
    except Exception as error:  # noqa: BLE001 - only the reference's own failure skips
        pytest.skip(f"no remat fails under vmap(grad) too: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
    assert_close(_per_sample(case, model), expected)
    _assert_rematerialized(case, model)


# ---------------------------------------------------------------- ResNet BasicBlock with BatchNorm


def _block_pair() -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    reference = Z.basic_block()
    return copy.deepcopy(reference), reference, torch.randn(4, 4, 8, 8, dtype=Z.D)


@pytest.mark.parametrize("policy_name", list(MODEL_POLICIES))
def test_resnet_block_module_matches_no_remat(policy_name: str) -> None:
    block, reference, x = _block_pair()
    checkpointed = remat.remat(block, policy=MODEL_POLICIES[policy_name])

    def run(f: Callable[[torch.Tensor], torch.Tensor], module: torch.nn.Module) -> Any:
        xs = [x.clone().requires_grad_() for _ in range(2)]
        outs = []
        for xi in xs:  # two steps: running statistics update twice, the second from the cache
            out = f(xi)
            out.pow(2).mean().backward()
            outs.append(out.detach())
        return outs, [xi.grad for xi in xs], {n: p.grad for n, p in module.named_parameters()}, _buffers(module)

    outs, x_grads, grads, buffers = run(checkpointed, block)
    ref_outs, ref_x_grads, ref_grads, ref_buffers = run(reference, reference)
    assert_close((outs, x_grads, grads), (ref_outs, ref_x_grads, ref_grads))
    _assert_bitwise(buffers, ref_buffers)
    assert buffers["bn1.num_batches_tracked"].item() == 2


@pytest.mark.parametrize("policy_name", list(MODEL_POLICIES))
def test_resnet_block_functional_call_with_buffers_matches_no_remat(policy_name: str) -> None:
    block, reference, x = _block_pair()
    checkpointed = remat.remat(block, policy=MODEL_POLICIES[policy_name])

    def run(module: torch.nn.Module, source: torch.nn.Module) -> Any:
        params, buffers = _params(source), _buffers(source)

        def loss_fn(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return functional_call(module, (params, buffers), (x,)).pow(2).mean()

        grads, loss = grad_and_value(loss_fn, argnums=(0, 2))(params, buffers, x)
        return loss, grads, buffers

    loss, grads, buffers = run(checkpointed, block)
    ref_loss, ref_grads, ref_buffers = run(reference, reference)
    assert_close((loss, grads), (ref_loss, ref_grads))
    _assert_bitwise(buffers, ref_buffers)  # the passed-in buffers were updated, once
    assert buffers["bn1.num_batches_tracked"].item() == 1
    _assert_bitwise(_buffers(block), _buffers(reference))  # the modules' own buffers untouched


# ---------------------------------------------------------------- things that are not a plain oracle


@pytest.mark.parametrize("policy_name", list(BUILT_IN_POLICIES))
def test_mixtral_style_moe_with_data_dependent_routing_replays_as_without_remat(policy_name: str) -> None:
    """Mixtral's `torch.where(expert_mask[e])` gives a data-dependent shape, which remat
    cannot trace: the layer runs as torch.utils.checkpoint runs it, saying why, and trains
    as without remat; with fallback=False it is refused naming the line and the op."""
    torch.manual_seed(0)
    reference = Z.MoEModel(Z.MixtralMoE).to(Z.D).train()
    model = copy.deepcopy(reference)
    remat.checkpoint_layers(model.blocks, BUILT_IN_POLICIES[policy_name])
    batch = Z._tokens(Z.BATCH)
    line = r"model_zoo\.py:\d+ \(`slot, token = torch\.where\(expert_mask\[e\]\)`\)"
    for step in range(2):  # the experts' dropout draws alike, and leaves the stream alike
        torch.manual_seed(step)
        expected = Z._lm_loss(reference(batch["input_ids"]), batch)
        expected.backward()
        expected_draw = torch.rand(1)
        torch.manual_seed(step)
        with pytest.warns(remat.RematFallbackWarning, match=line + r".*aten\.nonzero") if step == 0 else contextlib.nullcontext():
            actual = Z._lm_loss(model(batch["input_ids"]), batch)
        actual.backward()
        assert torch.equal(actual, expected) and torch.equal(torch.rand(1), expected_draw)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), name
    strict = copy.deepcopy(reference)
    remat.checkpoint_layers(strict.blocks, BUILT_IN_POLICIES[policy_name], fallback=False)
    with pytest.raises(RematError, match=line + r".*aten\.nonzero"):
        strict(batch["input_ids"])


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_default_kv_cache_replays_as_without_remat_naming_the_cache_and_the_fix(name: str) -> None:
    """LlamaConfig and GPT2Config default to use_cache=True, so a training forward makes a
    new DynamicCache and fills it inside each decoder layer, which a trace cannot (it would
    fill it with stand-ins): the layers replay, saying why and naming `use_cache=False`
    (which transformers' own gradient checkpointing sets), and the loss, every gradient
    and the cache the forward filled are bitwise those without remat: the recompute in
    backward sees the cache as the forward did, and leaves it as the forward left it."""

    def steps(use_remat: bool) -> list[Any]:
        torch.manual_seed(0)
        model = {"llama": Z.llama, "gpt2": Z.gpt2}[name]("sdpa", use_cache=True)
        assert model.config.use_cache
        layers = model.model.layers if name == "llama" else model.transformer.h
        if use_remat:
            remat.checkpoint_layers(layers, P.dots_saveable)
        seen = []
        for _ in range(2):
            out = model(**Z._tokens(Z.BATCH))
            out.logits.pow(2).mean().backward()
            cache = out.past_key_values.layers
            seen.append([out.logits, [p.grad.clone() for p in model.parameters()], [(c.keys, c.values) for c in cache]])
            model.zero_grad()
        return seen

    expected = steps(False)
    with pytest.warns(remat.RematFallbackWarning, match=r"stores a tensor it computes in `[a-z_]+\.layers\[0\]\.keys`.*use_cache=False"):
        actual = steps(True)
    assert_close(actual, expected, rtol=0, atol=0)


@pytest.mark.parametrize("policy_name", ["none", "dots", "budget"])
def test_attention_weights_returned_by_llama_eager_attention_are_differentiable(policy_name: str) -> None:
    """LlamaAttention returns (output, weights) with the output computed from the weights
    (after dropout): gradients with respect to the weights themselves, as without remat."""
    torch.manual_seed(SEED)
    model = Z.llama("eager")
    attention = model.model.layers[0].self_attn
    x = torch.randn(2, 6, Z.HIDDEN, dtype=Z.D, requires_grad=True)
    position_embeddings = model.model.rotary_emb(x, torch.arange(6)[None])

    def run(f: Callable[..., Any]) -> list[torch.Tensor]:
        torch.manual_seed(SEED)
        out, weights = f(x, position_embeddings=position_embeddings, attention_mask=None)
        gradients = torch.autograd.grad(out.pow(2).sum(), (weights, x, *attention.parameters()))
        return [out, weights, *gradients, torch.rand(2)]

    assert_close(run(remat.remat(attention, policy=MODEL_POLICIES[policy_name])), run(attention))


# ---------------------------------------------------------------- what Hugging Face records with hooks

# transformers records attentions, hidden states and MoE router logits with forward hooks
# on modules inside each layer; through checkpoint_layers those hooks run inside regions.
RECORDING_CASES = {
    "mixtral": (Z.mixtral, "eager", {}, "nothing"),
    "qwen3_moe": (Z.qwen3_moe, "sdpa", {}, "dots"),
    "llama": (Z.llama, "eager", {"output_attentions": True, "output_hidden_states": True}, "everything"),
    "mistral": (Z.mistral, "eager", {"output_attentions": True, "output_hidden_states": True}, "dots_no_batch"),
}


def _recorded_steps(model: torch.nn.Module, flags: dict[str, bool]) -> list[Any]:
    """A step at each of several sequence lengths (the last seen before): the loss with
    what the hooks recorded in it, so every gradient flows through those values too."""
    steps = []
    for length in (Z.SEQ, Z.SEQ + 3, Z.SEQ):
        ids = torch.randint(0, Z.VOCAB, (Z.BATCH, length), generator=torch.Generator().manual_seed(length))
        model.zero_grad()
        torch.manual_seed(SEED)
        out = model(input_ids=ids, labels=ids, **flags)
        recorded = [t for name in ("attentions", "hidden_states") for t in (getattr(out, name, None) or ())]
        assert all(type(t) is torch.Tensor for t in recorded)
        loss = out.loss + sum((t * t.cos()).sum() for t in recorded) * 1e-2
        if getattr(out, "aux_loss", None) is not None:
            assert type(out.aux_loss) is torch.Tensor
            steps.append(out.aux_loss.detach())
        loss.backward()
        steps.append((loss.detach(), [t.detach() for t in recorded], {n: p.grad.clone() for n, p in model.named_parameters()}))
        steps.append(torch.rand(2))
    return steps


@pytest.mark.parametrize("name", list(RECORDING_CASES))
def test_what_transformers_records_with_hooks_matches_no_remat(name: str) -> None:
    """MoE router logits and their load-balancing loss, attentions and hidden states: equal
    to no remat at several sequence lengths, with gradients through each."""
    build, attention, flags, policy_name = RECORDING_CASES[name]
    torch.manual_seed(0)
    reference = build(attention)
    model = copy.deepcopy(reference)
    remat.checkpoint_layers(model.model.layers, MODEL_POLICIES[policy_name])
    assert_close(_recorded_steps(model, flags), _recorded_steps(reference, flags), rtol=1e-10, atol=1e-12)


def _dinov3() -> torch.nn.Module:
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    config = DINOv3ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
        patch_size=8, num_register_tokens=1, hidden_dropout_prob=0.1,
    )
    return DINOv3ViTModel(config).double().train()


@pytest.mark.parametrize("policy_name", ["nothing", "dots"])
def test_a_model_that_caches_tensors_with_lru_cache_matches_no_remat(policy_name: str) -> None:
    """transformers' DINOv3 ViT computes its patch coordinates in a function cached with
    functools.lru_cache: remat of the whole model (the cache filled while it traces) gives
    the loss, every gradient and the random stream of no remat, over two sizes and a
    second call, and the model without remat afterwards computes real tensors."""
    pytest.importorskip("transformers.models.dinov3_vit")

    def steps(model: torch.nn.Module, call: Callable[..., Any]) -> list[Any]:
        torch.manual_seed(SEED)
        found = []
        for size in (32, 32, 24):
            x = torch.randn(2, 3, size, size, dtype=torch.float64)
            loss = call(pixel_values=x).last_hidden_state.pow(2).mean()
            loss.backward()
            found.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
            model.zero_grad()
        return [*found, torch.rand(2)]

    torch.manual_seed(0)
    reference = _dinov3()
    model = copy.deepcopy(reference)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematStateWarning)  # remat says it emptied the cache
        actual = steps(model, remat.remat(model, policy=MODEL_POLICIES[policy_name]))
    expected = steps(reference, reference)
    assert_close(actual, expected, rtol=0, atol=0)
    after = model(pixel_values=torch.randn(1, 3, 32, 32, dtype=torch.float64)).last_hidden_state
    assert type(after) is torch.Tensor


# ---------------------------------------------------------------- the whole model in one line

ONE_LINE = {  # architecture: (build, the policy it is tested under)
    "llama": (lambda: Z.llama("sdpa", use_cache=True), "dots"),
    "gpt2": (lambda: Z.gpt2("eager", use_cache=True), "nothing"),
    "bert": (lambda: Z.bert("sdpa"), "dots_no_batch"),
    "mistral": (lambda: Z.mistral("sdpa"), "budget"),
    "t5": (lambda: Z.t5("eager", use_cache=True), "dots_attention"),
}


@pytest.mark.parametrize("name", list(ONE_LINE))
def test_checkpoint_model_trains_a_transformers_model_as_without_remat_tracing_each_layer_once(name: str) -> None:
    """`remat.checkpoint_model(model, policy)` through transformers' own checkpointing switch:
    in training the model turns its cache off (as under its own checkpointing), every layer
    is a region named by its path that traces once and then runs from its cache while each
    step brings a new `functools.partial`; loss, gradients, buffers and the random stream
    as without remat (with the cache off, what the model runs under any checkpointing)."""
    build, policy_name = ONE_LINE[name]
    torch.manual_seed(0)
    reference = build()
    model = copy.deepcopy(reference)
    schedule = remat.checkpoint_model(model, MODEL_POLICIES[policy_name])
    layers = [m for path, m in model.named_modules() if path in schedule]
    assert len(schedule) == len(layers) >= 2 and all(p is MODEL_POLICIES[policy_name] for p in schedule.values())
    batch = (Z._padded_tokens if name == "bert" else Z._tokens)(Z.BATCH)
    case = Z.Case(name, build, lambda m: m, lambda n: batch, Z._hf_loss)
    reference_kwargs = {} if name in ("bert", "mistral") else {"use_cache": False}
    expected = _backward_steps_with(case, reference, reference_kwargs)
    _assert_steps_match(_backward_steps(case, model), expected)
    regions = [region for layer in layers for region in _REGIONS.table(layer).values()]
    assert len(regions) == len(layers)
    for region in regions:
        info = region.cache_info()
        assert info["traces"] + info["like"] == 1 and info["hits"] == 1 and info["replays"] == 0, info
    by_region = remat.report(lambda **kw: model(**kw).loss, **case.model_kwargs(batch)).by_region()
    assert set(by_region) == set(schedule)


def _backward_steps_with(case: Z.Case, model: torch.nn.Module, extra: dict[str, Any]) -> Any:
    """`_backward_steps`, the model called with `extra` keywords too."""
    call = model.forward
    model.forward = functools.partial(call, **extra)  # type: ignore[method-assign]
    try:
        return _backward_steps(case, model)
    finally:
        del model.forward


def test_checkpoint_model_gives_each_layer_its_policy_and_a_share_of_a_budget() -> None:
    """Per-layer specs by path and index range; "no remat" leaves a layer to transformers'
    plain forward; `budget=` gives the others a share each; the model's own switch turns
    it all off again."""
    torch.manual_seed(0)
    reference = Z.t5("eager")
    model = copy.deepcopy(reference)
    schedule = remat.checkpoint_model(model, {"decoder.block.1": "no remat", "*": None}, budget=1 << 16)
    assert schedule["decoder.block.1"] == "no remat"
    shares = [p for path, p in schedule.items() if path != "decoder.block.1"]
    assert shares == [P.memory_budget((1 << 16) // 3)] * 3
    batch = Z._tokens(Z.BATCH)
    case = Z.Case("t5", lambda: model, lambda m: m, lambda n: batch, Z._hf_loss)
    _assert_steps_match(_backward_steps(case, model), _backward_steps(case, reference))
    no_remat = dict(model.named_modules())["decoder.block.1"]
    assert not _REGIONS.table(no_remat)
    model.activation_checkpointing_disable()
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


@pytest.mark.parametrize("case_name", [case.name for case in Z.OWN_CASES])
def test_checkpoint_model_finds_the_layers_of_other_models(case_name: str) -> None:
    """Models that are not transformers': the one-liner finds the stack `checkpoint_layers`
    is given elsewhere in this file (a timm-style ViT's blocks, torch's encoder layers,
    mixture-of-experts blocks, not the experts inside them) and trains as without remat."""
    case = CASES[case_name]
    reference = copy.deepcopy(_prototype(case_name))
    model = copy.deepcopy(reference)
    schedule = remat.checkpoint_model(model, P.dots_saveable)
    paths = {id(m): path for path, m in model.named_modules()}
    assert list(schedule) == [paths[id(layer)] for layer in case.layers(model)]
    _assert_steps_match(_backward_steps(case, model), _backward_steps(case, reference))
    _assert_rematerialized(case, model, hits=1)


def test_checkpoint_model_composes_with_functional_call_and_grad() -> None:
    """The one-liner's regions under torch.func: grad over functional_call's parameters of a
    transformers Llama equals no remat (transformers' own checkpointing cannot run there)."""
    case = CASES["llama-sdpa"]
    reference = copy.deepcopy(_prototype(case.name))
    model = copy.deepcopy(reference)
    remat.checkpoint_model(model, P.dots_saveable)
    batch = case.batch(Z.BATCH)

    def grads(module: torch.nn.Module) -> Any:
        params = {k: v.detach() for k, v in module.named_parameters()}
        torch.manual_seed(SEED)
        return grad_and_value(lambda p: functional_call(module, p, (), case.model_kwargs(batch)).loss)(params)

    assert_close(grads(model), grads(reference))
