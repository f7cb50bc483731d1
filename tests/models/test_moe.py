"""Qwen3-MoE: logits against transformers, the HF round trip, routing replay, the step on an expert mesh, and
the refusals (replay on a dense model, a checkpoint of another expert count, bad routes)."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
import safetensors.torch
import torch
import transformers
from flax import nnx
from hf_reference import hf_logits, padded_batch
from tolerances import F32_EPS, forward_terms, sum_atol

from jaxflow import sharding
from jaxflow.config import ConfigError
from jaxflow.data.records import RouteSpec
from jaxflow.models import moe
from jaxflow.models.config import ModelConfig, from_hf_config, to_hf_config
from jaxflow.models.hf_io import export_model, load_model
from jaxflow.models.transformer import Transformer, positions_from_mask
from jaxflow.trainer import checkpoint
from jaxflow.trainer.batch import Trajectory, make_batch
from jaxflow.trainer.rl_trainer import step_config
from jaxflow.trainer.state import create_train_state, train_state_shardings
from jaxflow.trainer.step import StepConfig, TrainStep, float32_state

pytestmark = pytest.mark.slow  # the model against transformers; compiles the step on two meshes


def make_hf_moe(directory, *, norm_topk_prob: bool, tied: bool, seed: int = 0):
    """A random tiny Qwen3-MoE (4 experts, top-2, layer 1 of 3 dense) saved by transformers; the torch model."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[1], norm_topk_prob=norm_topk_prob, tie_word_embeddings=tied, rms_norm_eps=1e-5,
        max_position_embeddings=128)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
    model.eval().save_pretrained(directory)
    return model


@pytest.fixture(scope="module", params=[(n, t) for n in (False, True) for t in (False, True)],
                ids=lambda p: f"{'norm' if p[0] else 'raw'}-{'tied' if p[1] else 'untied'}")
def hf_moe(request, tmp_path_factory):
    norm, tied = request.param
    directory = tmp_path_factory.mktemp(f"moe-{norm}-{tied}")
    return make_hf_moe(directory, norm_topk_prob=norm, tied=tied), directory


def test_config_reads_the_layer_kinds(hf_moe):
    _, directory = hf_moe
    model = load_model(directory)
    cfg = model.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.sparse_layers, cfg.dense_layers) == (4, 2, (0, 2), (1,))
    assert from_hf_config(to_hf_config(cfg)) == cfg
    stacked = model.layers.stacked()
    assert stacked["expert_gate"].shape == (2, 4, 64, 32) and stacked["gate_proj"].shape == (1, 64, 96)
    assert stacked["router"].shape == (2, 64, 4) and stacked["q_proj"].shape[0] == 3


def test_logits_match_transformers(hf_moe):
    hf_model, directory = hf_moe
    model = load_model(directory)
    tokens, mask, positions = padded_batch()
    ref = hf_logits(hf_model, tokens, mask, positions)
    ours = np.asarray(nnx.jit(lambda m, t, p, s: m(t, p, s))(model, tokens, positions_from_mask(mask), mask))
    real = mask.astype(bool)
    # The dense family's tolerance (tests/models/test_models.py): two programs of the same forward.
    assert np.abs(ours[real] - ref[real]).max() < 1e-4
    assert np.abs(ours[real] - ref[real]).max() < sum_atol(forward_terms(model.config), np.abs(ref).max())


def test_export_round_trips_bit_for_bit(hf_moe, tmp_path):
    hf_model, directory = hf_moe
    out = export_model(load_model(directory), tmp_path / "export")
    original = safetensors.torch.load_file(directory / "model.safetensors")
    exported = safetensors.torch.load_file(out / "model.safetensors")
    assert sorted(original) == sorted(exported)
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in exported
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    tokens, mask, positions = padded_batch(seed=1)
    np.testing.assert_array_equal(hf_logits(reloaded, tokens, mask, positions),
                                  hf_logits(hf_model, tokens, mask, positions))


def test_a_checkpoint_of_another_expert_count_is_refused(tmp_path):
    other = tmp_path / "other"
    make_hf_moe(other, norm_topk_prob=False, tied=False)
    hf = (other / "config.json").read_text().replace('"num_local_experts": 4', '"num_local_experts": 8')
    (other / "config.json").write_text(hf)
    with pytest.raises(ValueError, match=r"missing tensor.*experts\.[4-7]"):
        load_model(other)


CFG = ModelConfig("Qwen3MoeForCausalLM", vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, mlp_only_layers=(1,), norm_topk_prob=True)
SEQ_LEN = 24
SPEC = RouteSpec(layers=2, top_k=2, num_experts=4)


def test_replaying_the_routers_own_choice_changes_nothing_and_other_routes_do():
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)), jnp.int32)
    h, stats = model.hidden_states(tokens, with_router=True)
    assert stats.topk_btk.shape == (2, 2, 16, 2)  # [L_sparse, B, T, k]
    own = jnp.moveaxis(stats.topk_btk, 0, 2)
    np.testing.assert_array_equal(model.hidden_states(tokens, routes_btlk=own), h)
    # -1 everywhere: every token routes itself.
    np.testing.assert_array_equal(model.hidden_states(tokens, routes_btlk=jnp.full_like(own, -1)), h)
    other = (own + 1) % CFG.num_experts  # the next expert over: a different pair for every token
    changed = model.hidden_states(tokens, routes_btlk=other)
    assert float(jnp.abs(changed - h).max()) > 1e-3
    np.testing.assert_array_equal(model.hidden_states(tokens, routes_btlk=own.at[:, 5:].set(other[:, 5:]))[:, :5],
                                  h[:, :5])  # causal: later positions cannot move earlier ones

    # The router learns through the replayed experts' gate values.
    def loss(router, routes):
        layers = nnx.state(model)
        layers["layers"]["router"] = layers["layers"]["router"].replace(value=router)
        m = nnx.merge(nnx.graphdef(model), layers)
        return jnp.sum(m.hidden_states(tokens, routes_btlk=routes) ** 2)

    grad = jax.grad(loss)(model.layers.router[...], other)
    assert float(jnp.abs(grad).max()) > 0


def test_replay_on_a_dense_model_is_refused():
    dense = ModelConfig("Qwen3ForCausalLM", vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
    model = Transformer(dense, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="dense model"):
        model.hidden_states(jnp.zeros((1, 4), jnp.int32), routes_btlk=jnp.zeros((1, 4, 1, 2), jnp.int32))
    trainer = ml_collections.ConfigDict({"loss": {"name": "decoupled_ppo"}, "minibatches": 1, "prox": "recompute",
                                         "remat": False, "moe": {"routing_replay": "rollout"}})
    with pytest.raises(ConfigError, match=r"trainer\.moe\.routing_replay.*dense"):
        step_config(trainer, model_config=dense)
    assert step_config(trainer, model_config=CFG).route_spec == RouteSpec(2, 2, 4)


def trajectories(seed=0, n=16, with_routes=True):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = int(rng.integers(3, 14))
        routes = None
        if with_routes:  # two distinct experts per token and layer
            first = rng.integers(0, 4, (k, 2))
            routes = np.stack([first, (first + rng.integers(1, 4, (k, 2))) % 4], -1).astype(np.int8)
        out.append(Trajectory(prompt=rng.integers(0, 128, int(rng.integers(2, 8))).tolist(),
                              completion=rng.integers(0, 128, k).tolist(),
                              behav_logp=(-4.8 + 0.3 * rng.normal(size=k)).tolist(), versions=[0] * k,
                              reward=float(rng.integers(0, 2)), group_id=i // 4, routes=routes))
    return out


def test_make_batch_places_routes_before_their_tokens_and_refuses_bad_ones():
    trajs = trajectories(n=4)
    batch, _ = make_batch(trajs, num_rows=4, seq_len=SEQ_LEN, route_spec=SPEC)
    routes, mask = np.asarray(batch.routes)[0], np.asarray(batch.loss_mask)[0] > 0
    assert routes.dtype == np.int8 and routes.shape == (4, SEQ_LEN, 2, 2)
    for row, t in enumerate(trajs):  # row order of an unpacked batch is the trajectories'
        first = int(np.argmax(mask[row]))  # the first completion token
        np.testing.assert_array_equal(routes[row, first - 1:first - 1 + len(t.completion)], t.routes)
        assert (routes[row, :first - 1] == -1).all() and (routes[row, first - 1 + len(t.completion):] == -1).all()
    bad = trajectories(n=1)
    bad[0].routes = bad[0].routes.copy()
    bad[0].routes[0, 0, 0] = 4
    with pytest.raises(ValueError, match=r"trajectory 0: routes span \[.*, 4\], outside \[-1, 3\]"):
        make_batch(bad, num_rows=4, seq_len=SEQ_LEN, route_spec=SPEC)
    bad[0].routes = bad[0].routes[:, :1]
    with pytest.raises(ValueError, match=r"trajectory 0: routes are int8 \(\d+, 1, 2\), expected"):
        make_batch(bad, num_rows=4, seq_len=SEQ_LEN, route_spec=SPEC)


@functools.cache
def _step_run(mesh_shape, replay: bool):
    """One SGD(lr=1) update of a fresh tiny MoE on the trajectories, on a (data, fsdp, expert, tensor) mesh:
    (loss, the gradient as params before - after, metrics), host arrays."""
    data, fsdp, expert, tensor = mesh_shape
    mesh = sharding.make_mesh(data, fsdp, tensor, devices=jax.devices()[:data * fsdp * expert * tensor],
                              expert=expert)
    cfg = StepConfig(routing_replay="rollout" if replay else "off", route_spec=SPEC,
                     router_aux_coef=0.01, router_z_coef=0.001)
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.device_put(params, sharding.state_shardings(params, mesh)))
    tx = float32_state(optax.sgd(1.0))
    state = create_train_state(model, tx, mesh)
    before = jax.tree.map(np.asarray, state.params)
    step = TrainStep(nnx.graphdef(model), tx, cfg, mesh, train_state_shardings(state.params, tx, mesh))
    batch, _ = make_batch(trajectories(), num_rows=16, seq_len=SEQ_LEN, micro_batches=2, route_spec=SPEC)
    state, metrics = step(state, batch)
    grads = jax.tree.map(lambda a, b: a - np.asarray(b), before, state.params)
    return jax.tree.map(np.asarray, metrics), grads, batch


@pytest.mark.parametrize("replay", [False, True], ids=["own-routes", "replay"])
def test_step_on_fsdp_expert_tensor_mesh_equals_one_device(replay):
    one, grads_one, batch = _step_run((1, 1, 1, 1), replay)
    eight, grads_eight, _ = _step_run((1, 2, 2, 2), replay)
    if not replay:  # the same routes, or the comparison below compares different functions
        assert one["expert_load_max"] == eight["expert_load_max"]
    else:
        assert 0 < one["route_flip_frac"] <= 1 and one["route_flip_frac"] == eight["route_flip_frac"]
    tokens = int(np.asarray(batch.loss_mask).sum())
    adv = float(np.abs(np.asarray(batch.advantages)).max())
    terms = tokens * forward_terms(CFG)
    np.testing.assert_allclose(eight["loss"], one["loss"], rtol=0, atol=sum_atol(terms, 2 * adv))
    for key in ("router_aux_loss", "router_z_loss"):
        np.testing.assert_allclose(eight[key], one[key], rtol=0, atol=sum_atol(terms, abs(one[key])))
    flat_one, flat_eight = (jax.tree_util.tree_leaves_with_path(g) for g in (grads_one, grads_eight))
    for (path, a), (_, b) in zip(flat_one, flat_eight):
        # A gradient element sums a term per token and per hidden unit it flows through; its rounding
        # is bounded by those terms' scale (the largest element of this parameter's gradient).
        scale = float(np.abs(a).max())
        np.testing.assert_allclose(b, a, rtol=0, atol=sum_atol(terms, scale) + 4 * F32_EPS * scale,
                                   err_msg=jax.tree_util.keystr(path))
    assert float(np.abs(grads_one["layers"]["router"]).max()) > 0


def test_a_train_state_of_another_expert_count_is_refused(tmp_path):
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    tx = float32_state(optax.sgd(1.0))
    state = create_train_state(Transformer(CFG, rngs=nnx.Rngs(0)), tx, mesh)
    manager = checkpoint.Checkpointer(tmp_path / "ckpt")
    manager.save(1, state)
    manager.wait_until_finished()
    other_cfg = ModelConfig(**{**CFG.__dict__, "num_experts": 8})
    other = create_train_state(Transformer(other_cfg, rngs=nnx.Rngs(1)), tx, mesh)
    kept = jax.tree.map(np.asarray, other.params)
    refused = r"'params/layers/expert_\w+' was saved with shape \(2, 4,.*expects \(2, 8,"
    with pytest.raises(ValueError, match=refused):
        manager.restore(other)
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(other.params)):
        np.testing.assert_array_equal(a, np.asarray(b))
    manager.close()


def test_router_losses_are_one_and_zero_at_a_uniform_router():
    stats = moe.RouterStats(topk_btk=jnp.zeros((1, 8, 2), jnp.int32), load_e=jnp.full((4,), 4.0),
                            prob_e=jnp.full((4,), 2.0), z=jnp.asarray(0.0), tokens=jnp.asarray(8.0))
    aux, z = moe.router_losses(stats, num_experts=4, top_k=2)
    assert float(aux) == pytest.approx(1.0) and float(z) == 0.0


def test_lora_goes_on_attention_only():
    from jaxflow.models import lora
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="lora targets gate_proj, up_proj, down_proj: a mixture-of-experts"):
        lora.attach(model.layers, lora.LoRASpec(4, 8.0), jax.random.key(0))
    lora.attach(model.layers, lora.LoRASpec(4, 8.0, lora.ATTENTION_TARGETS), jax.random.key(0))
    tokens = jnp.arange(12)[None] % 128
    before = Transformer(CFG, rngs=nnx.Rngs(0)).hidden_states(tokens)
    np.testing.assert_array_equal(model.hidden_states(tokens), before)  # B = 0: the base model's output


def test_the_warm_start_adds_the_load_balancing_loss_to_a_mixture_of_experts(tmp_path):
    """warm_start._sft_step: with aux_coef the routers' gradient gets the load-balancing term (the reported
    loss stays the demonstrations' NLL); without it, or on a dense model, the step is the NLL's alone."""
    from engine_helpers import lively_tiny_model, lively_tiny_moe_model

    from jaxflow.jobs.warm_start import _sft_step

    def one_step(directory, aux_coef):
        model = load_model(directory, mesh=sharding.make_mesh(devices=jax.devices()[:1]))
        graphdef, params = nnx.split(model, nnx.Param)
        tx = optax.sgd(1.0)
        trajs = [Trajectory([5, 6, 7], [8, 9, 10, 11], [0.0] * 4, [0] * 4, advantage=1.0)]
        batch = make_batch(trajs, num_rows=1, seq_len=16)[0]
        new, _, nll = _sft_step(graphdef, tx, aux_coef)(params, tx.init(params), batch)
        return params, new, float(nll)

    moe_dir = lively_tiny_moe_model(tmp_path / "moe")
    _, plain, nll = one_step(moe_dir, 0.0)
    _, balanced, nll_balanced = one_step(moe_dir, 1.0)
    assert nll_balanced == nll
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(plain)]
    router = [i for i, path in enumerate(paths) if "router" in path]
    plain_leaves, balanced_leaves = jax.tree.leaves(plain), jax.tree.leaves(balanced)
    assert router and all(float(jnp.max(jnp.abs(plain_leaves[i] - balanced_leaves[i]))) > 0 for i in router)
    dense_dir = lively_tiny_model(tmp_path / "dense")
    _, dense_plain, _ = one_step(dense_dir, 0.0)
    _, dense_coef, _ = one_step(dense_dir, 1.0)
    assert all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(dense_plain), jax.tree.leaves(dense_coef)))
