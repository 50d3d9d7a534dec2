"""`kt-sft prepare` + AutoModelForCausalLM(trust_remote_code) on tiny checkpoints written as transformers
saves them (per-expert keys), and the clear errors for bad checkpoints."""
import json
import re
import warnings

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import kt_sft
from kt_sft.cli import run
from kt_sft.integrations import modeling
from kt_sft.ops import timing
from kt_sft.peft.layer import KTExpertsLinear
from tiny_models import CONFIGS, auto_class, experts_rounded_to_bf16, save_checkpoint, tiny_model
from tolerances import FP32_IO, rel_l2


@pytest.fixture
def saved(tmp_path):
    def save(model_type):
        model = tiny_model(model_type)
        src = tmp_path / f"src_{model_type}"
        model.save_pretrained(src)
        (src / "tokenizer_config.json").write_text("{}")  # stands for the tokenizer files, copied
        return model, src
    return save


def test_a_load_that_changes_the_engine_settings_of_models_loaded_before_warns(saved, tmp_path, monkeypatch):
    # The settings are the process's: the last prepared model loaded had changed every other's threads and kernel
    # set without a word.
    _, src = saved("qwen3_moe")
    monkeypatch.setattr(modeling, "_loaded", [])
    threads = kt_sft.capabilities()["threads"]
    try:
        for name, count in (("first", 2), ("again", 2), ("second", 1)):
            assert run(["prepare", str(src), str(tmp_path / name), "--threads", str(count)]) == 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for name in ("first", "again"):
                transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name, trust_remote_code=True)
        with pytest.warns(RuntimeWarning, match=r"threads=1, .*the models loaded before it .*first.*threads=2"):
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "second", trust_remote_code=True)
    finally:
        kt_sft.configure(threads=threads)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_prepared_model_loads_through_auto_class_and_matches(saved, tmp_path, model_type):
    stock, src = saved(model_type)
    out = tmp_path / "prepared"
    assert run(["prepare", str(src), str(out), "--threads", "2"]) == 0
    # Copied, not linked: a save into the prepared directory (a tokenizer's, a training's output_dir) had written
    # through the links into the source model's files.
    assert not (out / "tokenizer_config.json").is_symlink()
    (out / "tokenizer_config.json").write_text('{"padding_side": "left"}')
    assert (src / "tokenizer_config.json").read_text() == "{}"
    assert not list(out.glob("*.safetensors"))
    model = auto_class(model_type).from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    assert type(model).__name__ == type(stock).__name__
    experts = [m for m in model.modules() if isinstance(m, KTExpertsLinear)]
    assert experts and all(m.gate_up_proj.device.type == "cpu" for m in experts)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_l2(model(ids).logits, stock(ids).logits) <= FP32_IO


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_prepared_model_in_bf16_holds_stock_dtypes_and_values(saved, tmp_path, model_type):
    # from_pretrained keeps some weights float32 in a BF16 model (DeepSeek-V3's routing bias): rounded, it routes
    # some tokens to other experts.
    _, src = saved(model_type)
    out = tmp_path / "prepared"
    assert run(["prepare", str(src), str(out)]) == 0
    stock = auto_class(model_type).from_pretrained(src, dtype=torch.bfloat16).state_dict()
    model = auto_class(model_type).from_pretrained(out, trust_remote_code=True, dtype=torch.bfloat16)
    compared = 0
    for name, t in model.state_dict().items():
        if name in stock and ".experts." not in name:
            assert t.dtype == stock[name].dtype and torch.equal(t, stock[name]), name
            compared += 1
    assert compared > 10


def test_gemma4_with_its_vision_tower_prepares_and_loads(tmp_path):
    # The published Gemma 4 26B-A4B holds a vision tower beside the text model: its weights load as the stock
    # model's (text batches here: images through Gemma 4 are not tested yet).
    from tiny_models import GEMMA4_TEXT, GEMMA4_VISION
    config = transformers.Gemma4Config(text_config=GEMMA4_TEXT, vision_config=GEMMA4_VISION)
    torch.manual_seed(0)
    stock = experts_rounded_to_bf16(transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32))
    save_checkpoint(stock.eval(), tmp_path / "src")
    assert run(["prepare", str(tmp_path / "src"), str(tmp_path / "out")]) == 0
    model = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out", trust_remote_code=True,
                                                                     dtype=torch.float32)
    assert sum(isinstance(m, KTExpertsLinear) for m in model.modules()) == 2
    vision = {n: p for n, p in stock.state_dict().items() if "vision" in n}
    assert vision and all(torch.equal(model.state_dict()[n], p) for n, p in vision.items())
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_l2(model(ids).logits, stock(ids).logits) <= FP32_IO


def test_the_keys_a_models_class_skips_are_skipped(saved, tmp_path):
    # Qwen3-Next publishes its multi-token-prediction module as `mtp.*`, which transformers' model skips on load
    # (_keys_to_ignore_on_load_unexpected); refused as weights of no module, it had kept the model from loading.
    stock, src = saved("qwen3_next")
    state = load_file(str(src / "model.safetensors"))
    save_file({**state, "mtp.fc.weight": torch.ones(64, 128), "mtp.layers.0.mlp.experts.0.gate_proj.weight":
               torch.ones(40, 64)}, str(src / "model.safetensors"), metadata={"format": "pt"})
    assert run(["prepare", str(src), str(tmp_path / "out")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True,
                                                              dtype=torch.float32)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_l2(model(ids).logits, stock(ids).logits) <= FP32_IO


@pytest.mark.parametrize("where", ["top", "rope_parameters"])
def test_minimax_m2s_rotary_dim_is_read_as_its_partial_rotary_factor(tmp_path, where):
    # MiniMax-M2's config.json gives `rotary_dim` (64 of 128), which transformers' configuration ignores: the
    # prepared model had rotated all of each head (logits 0.2 off here).
    config = CONFIGS["minimax_m2"]()
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.5}
    torch.manual_seed(0)
    stock = experts_rounded_to_bf16(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)).eval()
    save_checkpoint(stock, tmp_path / "src")
    published = json.loads((tmp_path / "src" / "config.json").read_text())
    rope = {k: v for k, v in published.pop("rope_parameters").items() if k != "partial_rotary_factor"}
    published.update({"rotary_dim": 8, **({"rope_theta": rope["rope_theta"]} if where == "top" else
                                          {"rope_parameters": rope})})
    (tmp_path / "src" / "config.json").write_text(json.dumps(published))
    assert run(["prepare", str(tmp_path / "src"), str(tmp_path / "out")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True,
                                                              dtype=torch.float32)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_l2(model(ids).logits, stock(ids).logits) <= FP32_IO


def test_an_activation_other_than_silu_is_refused_before_reading_weights(tmp_path):
    model = tiny_model("qwen3_moe")
    model.config.hidden_act = "gelu"
    model.save_pretrained(tmp_path / "src")
    with pytest.raises(ValueError, match="hidden_act='gelu'; the CPU experts compute qwen3_moe's experts with silu"):
        run(["prepare", str(tmp_path / "src"), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_gemma4_is_checked_by_the_field_its_experts_read():
    # Gemma 4's experts read hidden_activation (GeGLU with the tanh gelu, which the engine computes); the exact gelu
    # is another unit, whatever hidden_act says.
    from kt_sft.models import architecture_of
    config = CONFIGS["gemma4_text"]()
    config.hidden_activation, config.hidden_act = "gelu", "gelu_pytorch_tanh"
    with pytest.raises(ValueError, match="gemma4_text uses hidden_activation='gelu'; the CPU experts compute "
                                         "gemma4_text's experts with gelu_pytorch_tanh or gelu_new only"):
        architecture_of(config)


def test_deepseek_v2_group_limited_routing_is_refused():
    # transformers 5.6's DeepseekV2Moe fails on that path at the first forward (stock too); prepare, which asks
    # architecture_of as it does for hidden_act, had accepted it.
    from kt_sft.models import architecture_of
    with pytest.raises(ValueError, match="topk_method 'group_limited_greedy'.*fails in transformers"):
        architecture_of(transformers.DeepseekV2Config(topk_method="group_limited_greedy"))
    architecture_of(transformers.DeepseekV2Config(topk_method="greedy"))


def test_the_checkpoints_generation_config_is_loaded(saved, tmp_path):
    # A prepared model's generation config had been built from config.json alone: the checkpoint's eos ids and
    # sampling defaults were lost (generate ran past the second eos id).
    stock, src = saved("qwen3_moe")
    transformers.GenerationConfig(eos_token_id=[5, 7], max_new_tokens=4, repetition_penalty=1.5).save_pretrained(src)
    assert run(["prepare", str(src), str(tmp_path / "prepared")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "prepared", trust_remote_code=True)
    config = model.generation_config
    assert (config.eos_token_id, config.max_new_tokens, config.repetition_penalty) == ([5, 7], 4, 1.5)


def test_missing_shard_is_named(saved, tmp_path):
    _, src = saved("qwen3_moe")
    (src / "model.safetensors").rename(src / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="lacks shard.*model-00002-of-00002"):
        run(["prepare", str(src), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_a_stale_index_is_named(saved, tmp_path):
    # The index puts an expert weight in a shard that does not hold it.
    _, src = saved("qwen3_moe")
    from safetensors.torch import load_file, save_file
    state = load_file(str(src / "model.safetensors"))
    key = "model.layers.0.mlp.experts.3.up_proj.weight"
    moved = {key: state.pop(key)}
    save_file(state, str(src / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(moved, str(src / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    (src / "model.safetensors").unlink()
    weight_map = {k: "model-00001-of-00002.safetensors" for k in [*state, key]}  # key is in the second
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(ValueError, match=f"index puts {key} in model-00001-of-00002.safetensors, which does not hold"):
        run(["prepare", str(src), str(tmp_path / "out")])


def prepared_matches(src, out, stock):
    """src prepared into out and loaded through the auto class gives stock's logits."""
    assert run(["prepare", str(src), str(out)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_l2(model(ids).logits, stock(ids).logits) <= FP32_IO


def test_a_single_file_beside_an_index_is_read_as_transformers_reads_it(saved, tmp_path):
    # from_pretrained reads model.safetensors where both are present; the loader had read the index's shards.
    stock, src = saved("qwen3_moe")
    from safetensors.torch import load_file, save_file
    other = {k: torch.randn_like(v) for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(other, str(src / "model-00001-of-00001.safetensors"), metadata={"format": "pt"})
    weight_map = {k: "model-00001-of-00001.safetensors" for k in other}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    prepared_matches(src, tmp_path / "out", stock)


@pytest.mark.parametrize("stored", ["both", "lm_head_only"])
def test_tied_embeddings_follow_what_the_checkpoint_holds(tmp_path, stored):
    # config.json ties them. A checkpoint with its own, other lm_head keeps it, as from_pretrained does (the loader
    # had tied it to the embeddings, logits wholly off); one with the lm_head alone ties the other way round (it had
    # been refused as incomplete).
    from safetensors.torch import load_file, save_file
    src = tmp_path / "src"
    save_checkpoint(tiny_model("qwen3_moe"), src)
    state = load_file(str(src / "model.safetensors"))
    if stored == "lm_head_only":
        state["lm_head.weight"] = state.pop("model.embed_tokens.weight")
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    stock = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    prepared_matches(src, tmp_path / "out", stock)


def fused_copy(src, layers=2, experts=8):
    """The checkpoint in src with its experts stored as the transformers 5 module holds them, as a raw state_dict
    save writes them."""
    state = load_file(str(src / "model.safetensors"))
    for layer in range(layers):
        p = f"model.layers.{layer}.mlp.experts."
        state[p + "gate_up_proj"] = torch.stack([torch.cat([state.pop(f"{p}{e}.gate_proj.weight"),
                                                            state.pop(f"{p}{e}.up_proj.weight")])
                                                 for e in range(experts)])
        state[p + "down_proj"] = torch.stack([state.pop(f"{p}{e}.down_proj.weight") for e in range(experts)])
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    return state


@pytest.mark.parametrize("expert_format", [None, "int4"])
def test_experts_stored_fused_load_and_match(saved, tmp_path, expert_format):
    # Refused before ("save it with save_pretrained"): a raw state_dict save keeps the experts as the transformers 5
    # module holds them, which is the engine's layout.
    stock, src = saved("qwen3_moe")
    fused_copy(src)
    extra = ["--expert-format", expert_format] if expert_format else []
    assert run(["prepare", str(src), str(tmp_path / "out"), *extra]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True,
                                                              dtype=torch.float32)
    experts = [m for m in model.modules() if isinstance(m, KTExpertsLinear)]
    assert len(experts) == 2 and all(m.expert_format == (expert_format or "bf16") for m in experts)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(ids).logits, stock(ids).logits
    assert rel_l2(got, want) <= (FP32_IO if expert_format is None else 0.2)  # INT4: the format's rounding


def test_fused_experts_that_disagree_with_the_config_are_named(saved, tmp_path):
    _, src = saved("qwen3_moe")
    state = fused_copy(src)
    key = "model.layers.1.mlp.experts.down_proj"
    save_file({**state, key: state[key][:, :, :-1].contiguous()}, str(src / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(key) + r" have shapes \[8, 80, 64\] and \[8, 64, 39\] but "
                                         r"config.json implies \[8, 80, 64\] and \[8, 64, 40\] \(fused experts"):
        run(["prepare", str(src), str(tmp_path / "out")])
    save_file({k: v for k, v in state.items() if k != key}, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"has model.layers.1.mlp.experts.gate_up_proj but no " + re.escape(key)):
        run(["prepare", str(src), str(tmp_path / "out")])


def test_config_that_disagrees_with_weights_is_refused(saved, tmp_path):
    _, src = saved("qwen3_moe")
    cfg = json.loads((src / "config.json").read_text())
    cfg["moe_intermediate_size"] = 48
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.weight has shape \[40, 64\] but config.json implies"):
        run(["prepare", str(src), str(tmp_path / "out")])


def test_unsupported_model_type_is_refused_before_reading_weights(tmp_path):
    src = tmp_path / "llama"
    transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=64, vocab_size=64).save_pretrained(src)
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        run(["prepare", str(src), str(tmp_path / "out")])


def test_unprepared_directory_gives_the_fix(saved):
    from kt_sft.integrations.modeling import KTSFTForCausalLM

    _, src = saved("qwen3_moe")
    config = transformers.AutoConfig.from_pretrained(src)
    with pytest.raises(ValueError, match="run `kt-sft prepare"):
        KTSFTForCausalLM.from_pretrained(src, config=config)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_expert_reads_match_safetensors(tmp_path, dtype, monkeypatch):
    from safetensors.torch import save_file

    from kt_sft.loader.checkpoint import Checkpoint

    g = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": torch.randn(5 + i, 7, generator=g).to(dtype) for i in range(3)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ckpt = Checkpoint(tmp_path)
    # Plain file reads, in every dtype: a memory map keeps the pages it touched in the process's RSS.
    monkeypatch.setattr(Checkpoint, "get", lambda *a: pytest.fail("read through the memory map"))
    fused = torch.empty(2, 6, 7, dtype=torch.bfloat16)
    ckpt.read_into("w1", fused[0])  # a slice of a larger buffer, as the loader fills expert stacks
    assert torch.equal(fused[0], tensors["w1"].to(torch.bfloat16))
    with pytest.raises(ValueError, match="has shape"):
        ckpt.read_into("w0", fused[1])


def test_kimi_k2_checkpoint_is_served_as_deepseek_v3(saved, tmp_path):
    stock, src = saved("deepseek_v3")
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "kimi_k2"  # as Kimi-K2 publishes it, with its own remote code
    cfg["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                       "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
    (src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "prepared"
    assert run(["prepare", str(src), str(out)]) == 0
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "deepseek_v3" and written["kt_sft"]["source_model_type"] == "kimi_k2"
    model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_l2(model(ids).logits, stock(ids).logits) <= FP32_IO


def test_step_profile_reports_where_training_steps_go(saved, tmp_path, monkeypatch, capsys):
    _, src = saved("qwen3_moe")
    out = tmp_path / "prepared"
    assert run(["prepare", str(src), str(out)]) == 0
    monkeypatch.setenv("KT_SFT_PROFILE", "2")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)  # evaluation forwards are not steps
    model.train()
    try:
        for _ in range(5):
            model(input_ids=ids, labels=ids).loss.backward()
    finally:
        timing.profile_engine_phases(False)  # the step profile turned it on for the process
    err = capsys.readouterr().err.splitlines()
    lines = [line for line in err if line.startswith("kt_sft step")]
    assert [line.split(":")[0] for line in lines] == ["kt_sft step 2", "kt_sft step 4"]
    assert "CPU experts forward" in lines[0] and "GPU wait" in lines[0]
    phases = err[err.index(lines[0]) + 1]  # the engine's phases, summed over layers, on the next line
    assert phases.startswith("  engine phases (ms): forward.route_inputs") and "backward.dx " in phases, phases


def test_bad_step_profile_setting_is_named(monkeypatch):
    from kt_sft._ext import profile_every

    monkeypatch.setenv("KT_SFT_PROFILE", "often")
    with pytest.raises(ValueError, match="KT_SFT_PROFILE"):
        profile_every()


@pytest.mark.parametrize("kwargs, match", [
    # LLaMA-Factory's quantization_bit: loaded without it, without a word, before.
    ({"quantization_config": transformers.BitsAndBytesConfig(load_in_4bit=True)}, "does not take a quantization_config"),
    ({"device_map": "balanced"}, "device_map='balanced' spreads a model over several devices"),  # torch's error before
])
def test_loading_options_a_kt_sft_model_cannot_honour_are_refused(saved, tmp_path, kwargs, match):
    _, src = saved("qwen3_moe")
    assert run(["prepare", str(src), str(tmp_path / "prepared")]) == 0
    with pytest.raises(ValueError, match=match):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "prepared", trust_remote_code=True, **kwargs)


def test_a_bad_engine_setting_is_refused_before_loading(saved, tmp_path, monkeypatch):
    # Raised by the first experts module only, it came after every other weight of the model had been read.
    from kt_sft import _ext
    from kt_sft.models import use_cpu_experts
    _, src = saved("qwen3_moe")
    assert run(["prepare", str(src), str(tmp_path / "prepared")]) == 0
    monkeypatch.setattr(_ext, "settings_error", RuntimeError("KT_SFT_KERNELS='x': no such kernel set"))
    (src / "model.safetensors").write_bytes(b"")  # nothing may be read before the refusal
    with pytest.raises(RuntimeError, match="KT_SFT_KERNELS='x'"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "prepared", trust_remote_code=True)
    with pytest.raises(RuntimeError, match="KT_SFT_KERNELS='x'"):
        use_cpu_experts(tiny_model("qwen3_moe"))


def test_a_distributed_launch_is_refused_before_loading(saved, tmp_path, monkeypatch):
    # LLaMA-Factory starts one process per visible GPU (torchrun): each would load every routed expert into RAM.
    from kt_sft.models import use_cpu_experts
    _, src = saved("qwen3_moe")
    assert run(["prepare", str(src), str(tmp_path / "prepared")]) == 0
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="one of 2 processes of a distributed launch.*CUDA_VISIBLE_DEVICES=0"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "prepared", trust_remote_code=True)
    with pytest.raises(ValueError, match="distributed launch"):
        use_cpu_experts(tiny_model("qwen3_moe"))


@pytest.mark.parametrize("model_type, declared", [
    ("deepseek_v3", {"num_nextn_predict_layers": 1}), ("glm4_moe", {"num_nextn_predict_layers": 1}),
    # MiniMax-M2: num_mtp_modules of mtp_transformer_layers each (refused as layers past the model before).
    ("minimax_m2", {"num_mtp_modules": 1, "mtp_transformer_layers": 1})])
def test_a_multi_token_prediction_layer_past_the_configs_layers_is_skipped(tmp_path, model_type, declared):
    """DeepSeek-V3/R1, GLM-4.5 and MiniMax-M2 publish their multi-token-prediction layers (61; 92, 46 for Air; 62
    on) as more `model.layers.N` with routed experts; transformers skips them on load, and so must the hybrid
    loader."""
    import transformers as tf
    from tiny_models import CONFIGS as configs
    config = configs[model_type]()
    config.num_hidden_layers += 1
    torch.manual_seed(0)
    src = tmp_path / "src"
    save_checkpoint(tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32), src)
    published = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**published, "num_hidden_layers": config.num_hidden_layers - 1,
                                                 **declared}))
    stock = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()  # warns of the extra layer
    with torch.no_grad():
        for name, p in stock.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(p.bfloat16().float())  # as the engine stores them
    assert run(["prepare", str(src), str(tmp_path / "prepared")]) == 0
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "prepared", trust_remote_code=True, dtype=torch.float32)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_l2(model(ids).logits, stock(ids).logits) <= FP32_IO


@pytest.mark.parametrize("model_type,nextn", [("qwen3_moe", None), ("deepseek_v3", 0)])
def test_layers_past_the_configs_layers_that_no_prediction_layer_explains_are_refused(saved, tmp_path, model_type,
                                                                                     nextn):
    # They were skipped like DeepSeek-V3's multi-token-prediction layer: a config.json with a smaller
    # num_hidden_layers loaded a shorter model (logits 0.53 off) without a word.
    _, src = saved(model_type)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] -= 1
    if nextn is not None:
        config["num_nextn_predict_layers"] = nextn
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"holds layer {config['num_hidden_layers']} .*past the "
                                         rf"{config['num_hidden_layers']} layers that config.json's num_hidden_layers"):
        run(["prepare", str(src), str(tmp_path / "prepared")])


@pytest.mark.parametrize("routing", [dict(n_group=3), dict(topk_group=4), dict(n_group=4, num_experts_per_tok=3),
                                     dict(n_group=8, topk_group=2)],
                         ids=["groups_split_no_experts_evenly", "more_groups_picked_than_there_are", "top_k_past_groups",
                              "groups_of_one"])
def test_group_routing_that_does_not_fit_the_experts_is_refused(saved, tmp_path, routing):
    # Accepted, then a failure in the router's reshape or, at some token counts, routing within groups that straddle
    # tokens.
    _, src = saved("deepseek_v3")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **routing}))
    with pytest.raises(ValueError, match="config.json's group routing does not fit its 8 experts"):
        run(["prepare", str(src), str(tmp_path / "prepared")])


def test_a_layer_that_a_class_pattern_names_is_read_where_the_model_has_it(tmp_path):
    # Glm4MoeForCausalLM skips `model.layers.46.*` (GLM-4.5-Air's prediction layer), a real layer of GLM-4.5's 92:
    # its weights had been skipped by that pattern, and prepare refused the checkpoint as lacking them. transformers
    # skips only keys that name no weight of the model.
    config = CONFIGS["glm4_moe"]()
    config.num_hidden_layers = 47
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    save_checkpoint(stock, tmp_path / "src")
    assert run(["prepare", str(tmp_path / "src"), str(tmp_path / "out")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True,
                                                              dtype=torch.float32)
    assert torch.equal(model.model.layers[46].self_attn.q_proj.weight, stock.model.layers[46].self_attn.q_proj.weight)
