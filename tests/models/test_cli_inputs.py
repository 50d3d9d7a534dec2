"""What the command line does with bad input: every case ends in one sentence naming the problem and the fix,
nothing the user saved is overwritten, and the installed `kt-sft` prints that sentence without a traceback."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kt_sft.cli import main, run
from kt_sft.models import use_cpu_experts
from test_export_adapter import trained_adapter
from test_prepare_load import fused_copy
from tiny_models import CONFIGS, save_checkpoint, tiny_model


@pytest.fixture
def adapter(tmp_path):
    """(model dir, adapter dir) of a tiny qwen3_moe with LoRA on its experts and o_proj (r=4)."""
    _, model_dir = trained_adapter("qwen3_moe", tmp_path)
    return model_dir, tmp_path / "adapter"


def with_config(adapter_dir, tmp_path, text):
    """A copy of the adapter whose adapter_config.json holds `text`."""
    other = tmp_path / "edited"
    shutil.rmtree(other, ignore_errors=True)
    shutil.copytree(adapter_dir, other)
    (other / "adapter_config.json").write_text(text)
    return other


def config_with(adapter_dir, **changes):
    return json.dumps({**json.loads((adapter_dir / "adapter_config.json").read_text()), **changes})


@pytest.mark.parametrize("text, message", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "holds a JSON list, not an adapter configuration"),
    ({"r": 0}, r"gives r = 0; a LoRA adapter's rank is a positive integer"),
    ({"r": "4"}, r"gives r = '4'"),
    ({"r": None}, r"gives r = None"),
    ({"lora_alpha": None}, r"gives lora_alpha = None; it must be a finite number"),
    ({"rank_pattern": [1]}, r"gives rank_pattern = \[1\]; PEFT saves it as an object"),
], ids=["bad_json", "json_list", "r_zero", "r_string", "r_missing", "alpha_null", "rank_pattern_list"])
@pytest.mark.parametrize("command", ["merge", "export"])
def test_a_broken_adapter_config_is_named(adapter, tmp_path, text, message, command):
    model_dir, adapter_dir = adapter
    other = with_config(adapter_dir, tmp_path, text if isinstance(text, str) else config_with(adapter_dir, **text))
    args = [str(model_dir), str(other)] if command == "merge" else [str(other)]
    with pytest.raises(ValueError, match=message):
        run([command, *args, str(tmp_path / "out"), *(["--model", str(model_dir)] if command == "export" else [])])
    assert not (tmp_path / "out").exists()


def test_null_patterns_read_as_none(adapter, tmp_path):
    model_dir, adapter_dir = adapter
    other = with_config(adapter_dir, tmp_path, config_with(adapter_dir, rank_pattern=None, alpha_pattern=None))
    assert run(["merge", str(model_dir), str(other), str(tmp_path / "merged")]) == 0
    assert run(["export", str(other), str(tmp_path / "per_expert"), "--model", str(model_dir)]) == 0


@pytest.mark.parametrize("command", ["merge", "export"])
def test_a_config_whose_rank_is_not_its_weights_is_refused(adapter, tmp_path, command):
    # PEFT refuses to load such an adapter; a merge with scaling alpha / 8 would halve every update silently, and
    # an export would write a config of rank 8 over rank-4 weights.
    model_dir, adapter_dir = adapter
    other = with_config(adapter_dir, tmp_path, config_with(adapter_dir, r=8))
    args = [str(model_dir), str(other), str(tmp_path / "out")] if command == "merge" else \
        [str(other), str(tmp_path / "out"), "--model", str(model_dir)]
    with pytest.raises(ValueError, match=r"is shaped \[8, 4, \d+\], not a rank-8 stack .* do not belong together"):
        run([command, *args])
    assert not (tmp_path / "out").exists()


def test_prepare_prints_the_absolute_path_to_train_from(adapter, tmp_path, monkeypatch, capsys):
    # The printed path goes into LLaMA-Factory's model_name_or_path, which PEFT records as the adapter's base:
    # relative, export and merge run from elsewhere could not find it.
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", str(adapter[0]), "prep"]) == 0
    assert f"model_name_or_path: {tmp_path / 'prep'}," in capsys.readouterr().out


def test_merge_into_the_current_directory(adapter, tmp_path, monkeypatch):
    model_dir, adapter_dir = adapter
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert run(["merge", str(model_dir), str(adapter_dir), "."]) == 0
    assert (tmp_path / "here" / "model.safetensors").exists() and (tmp_path / "here" / "config.json").exists()
    assert not list(tmp_path.glob(".*merging"))


def test_a_prepared_directory_whose_model_moved_is_named(adapter, tmp_path):
    model_dir, adapter_dir = adapter
    assert run(["prepare", str(model_dir), str(tmp_path / "prepared")]) == 0
    model_dir.rename(tmp_path / "moved")
    with pytest.raises(FileNotFoundError, match=r"was prepared from .*model, which has no config.json now"):
        run(["merge", str(tmp_path / "prepared"), str(adapter_dir), str(tmp_path / "out")])
    with pytest.raises(FileNotFoundError, match=r"was prepared from .*model, which has no config.json now .* prepare"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "prepared", trust_remote_code=True)


def test_a_prepared_directory_whose_model_was_replaced_is_named(adapter, tmp_path):
    # Another release in the model's place (an FP8 one of an INT4 model's shapes) loaded through the prepared
    # config.json: quantized to the old format without a word, or refused as that config.json's fault.
    model_dir, _ = adapter
    assert run(["prepare", str(model_dir), str(tmp_path / "prepared")]) == 0
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    with pytest.raises(ValueError, match=r"model/config.json changed since `kt-sft prepare` wrote .*prepare` again"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "prepared", trust_remote_code=True)
    assert run(["prepare", str(model_dir), str(tmp_path / "prepared")]) == 0
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "prepared", trust_remote_code=True)


def test_export_never_writes_over_an_existing_directory(adapter, tmp_path):
    model_dir, adapter_dir = adapter
    before = {p.name: p.read_bytes() for p in adapter_dir.iterdir()}
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        run(["export", str(adapter_dir), str(adapter_dir), "--model", str(model_dir)])
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        run(["export", str(adapter_dir), str(model_dir), "--model", str(model_dir)])
    assert {p.name: p.read_bytes() for p in adapter_dir.iterdir()} == before


def test_export_checks_the_adapter_against_its_model(adapter, tmp_path, monkeypatch):
    model_dir, adapter_dir = adapter
    _, mixtral_dir = trained_adapter("mixtral", tmp_path / "mixtral")
    state = load_file(str(adapter_dir / "adapter_model.safetensors"))
    experts = next(t.shape[0] for k, t in state.items() if "experts.lora_A" in k)
    cfg = json.loads((mixtral_dir / "config.json").read_text())
    assert cfg["num_local_experts"] != experts  # the check below is the expert count's
    with pytest.raises(ValueError, match=r"experts first\), but the model has .* export it with the model it was"):
        run(["export", str(adapter_dir), str(tmp_path / "out"), "--model", str(mixtral_dir)])
    # Without --model and with no base model named, the current directory's config.json is not taken for it.
    monkeypatch.chdir(mixtral_dir)
    with pytest.raises(FileNotFoundError, match="base_model_name_or_path is empty.*--model"):
        run(["export", str(adapter_dir), str(tmp_path / "out")])
    save_file(state, str(adapter_dir / "adapter_model.safetensors"))  # untouched by both


def test_prepare_refuses_what_would_not_work(adapter, tmp_path):
    model_dir, _ = adapter
    with pytest.raises(ValueError, match="is inside the model directory"):
        run(["prepare", str(model_dir), str(model_dir / "prepared")])
    with pytest.raises(ValueError, match=r"--threads=100000 is out of range: the engine takes 0 .* to \d+ threads"):
        run(["prepare", str(model_dir), str(tmp_path / "prepared"), "--threads", "100000"])
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file; choose a directory"):
        run(["prepare", str(model_dir), str(tmp_path / "a_file")])
    assert not (model_dir / "prepared").exists() and not (tmp_path / "prepared").exists()
    (model_dir / "model.safetensors").write_bytes(b"\x10\x00")  # a download cut short
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file .* download or save it"):
        run(["prepare", str(model_dir), str(tmp_path / "prepared")])


def test_the_installed_command_prints_the_sentence_without_a_traceback(adapter, tmp_path, capsys):
    model_dir, adapter_dir = adapter
    assert main(["merge", str(model_dir), str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kt-sft: ") and "has no adapter_config.json" in err
    assert "Traceback" not in err and err.count("\n") == 1
    (tmp_path / "broken").mkdir()
    shutil.copy(adapter_dir / "adapter_config.json", tmp_path / "broken")
    (tmp_path / "broken" / "adapter_model.safetensors").write_bytes(b"\x10\x00")
    assert main(["merge", str(model_dir), str(tmp_path / "broken"), str(tmp_path / "out")]) == 2
    assert "broken/adapter_model.safetensors is not a readable safetensors file" in capsys.readouterr().err


def test_merge_takes_the_weights_of_a_model_saved_from_a_kt_sft_one(adapter, tmp_path):
    # A full fine-tune's output keeps config.json's kt_sft section (its source: the model it started from) beside
    # weights of its own: those are the ones to merge into, not the source's.
    model_dir, adapter_dir = adapter
    tuned = tmp_path / "tuned"
    shutil.copytree(model_dir, tuned)
    state = load_file(str(tuned / "model.safetensors"))
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * 2
    save_file(state, str(tuned / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((tuned / "config.json").read_text())
    (tuned / "config.json").write_text(json.dumps({**cfg, "kt_sft": {"source": str(model_dir)}}))
    assert run(["merge", str(tuned), str(adapter_dir), str(tmp_path / "merged")]) == 0
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert torch.equal(merged["model.embed_tokens.weight"], state["model.embed_tokens.weight"])


def test_merge_refuses_an_adapter_trained_on_a_model_with_other_experts(adapter, tmp_path):
    # Its experts 0..7 would have been merged into the first eight of sixteen without a word.
    _, adapter_dir = adapter
    config = CONFIGS["qwen3_moe"]()
    config.num_experts *= 2
    other = tmp_path / "wider"
    save_checkpoint(transformers.AutoModelForCausalLM.from_config(config), other)
    with pytest.raises(ValueError, match=r"is shaped \[8, .* but the model has 16 experts"):
        run(["merge", str(other), str(adapter_dir), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_merge_into_experts_stored_fused_gives_what_the_per_expert_merge_gives(adapter, tmp_path):
    # Refused before (and it had said, earlier still, that the expert LoRA names no weight of the checkpoint). Each
    # expert's update goes into its slice of the fused tensors, which stay fused.
    model_dir, adapter_dir = adapter
    other = tmp_path / "fused"
    shutil.copytree(model_dir, other)
    fused_copy(other)
    assert run(["merge", str(model_dir), str(adapter_dir), str(tmp_path / "per_expert")]) == 0
    assert run(["merge", str(other), str(adapter_dir), str(tmp_path / "out")]) == 0
    want = fused_copy(tmp_path / "per_expert")
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def indexed_copy(model_dir, tmp_path, shard_name):
    """A copy of the model whose index names its one shard `shard_name` (the shard moved there when inside)."""
    other = tmp_path / "indexed"
    shutil.copytree(model_dir, other)
    keys = list(load_file(other / "model.safetensors"))
    if shard_name.startswith(("/", "..")):
        (other / "model.safetensors").unlink()  # read before any index, as transformers reads a directory
    else:
        (other / shard_name).parent.mkdir(parents=True, exist_ok=True)
        (other / "model.safetensors").rename(other / shard_name)
    (other / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: shard_name for k in keys}}))
    return other


@pytest.mark.parametrize("where", ["absolute", "parent"])
@pytest.mark.parametrize("command", ["merge", "prepare"])
def test_an_index_naming_a_shard_outside_its_directory_is_refused(adapter, tmp_path, where, command):
    # merge writes each shard under the name the index gives it: one outside would be overwritten in place.
    model_dir, adapter_dir = adapter
    name = str((model_dir / "model.safetensors").resolve()) if where == "absolute" else "../model/model.safetensors"
    other = indexed_copy(model_dir, tmp_path, name)
    before = (model_dir / "model.safetensors").read_bytes()
    args = [str(other), str(adapter_dir)] if command == "merge" else [str(other)]
    with pytest.raises(ValueError, match="outside the checkpoint directory; shard names must be files inside it"):
        run([command, *args, str(tmp_path / "out")])
    assert (model_dir / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize("command", ["merge", "prepare"])
def test_an_index_naming_a_directory_as_a_shard_is_refused(adapter, tmp_path, command):
    # A directory passed the check for missing shards, and safetensors then said "No such device (os error 19)".
    model_dir, adapter_dir = adapter
    other = indexed_copy(model_dir, tmp_path, "weights/model.safetensors")
    index = json.loads((other / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "weights"
    (other / "model.safetensors.index.json").write_text(json.dumps(index))
    args = [str(other), str(adapter_dir)] if command == "merge" else [str(other)]
    with pytest.raises(FileNotFoundError, match="lacks shard.s. weights named by its index"):
        run([command, *args, str(tmp_path / "out")])


def test_a_shard_that_exists_but_cannot_be_opened_is_named(adapter, tmp_path, monkeypatch):
    # safetensors says "No such file or directory" for a file this user may not read (a shared model directory
    # written with umask 077); as root, which reads any file, the refusal is what the test can make.
    from kt_sft.loader import checkpoint

    def refused(path, framework):
        raise OSError(f"No such file or directory: {path}")
    monkeypatch.setattr(checkpoint, "safe_open", refused)
    model_dir, _ = adapter
    with pytest.raises(ValueError, match=r"model.safetensors exists but could not be opened for reading \(No such "
                                         r"file.*\): check that"):
        run(["prepare", str(model_dir), str(tmp_path / "out")])


def test_an_expert_weight_that_is_not_finite_is_named_by_merge_and_load(adapter, tmp_path):
    # Loaded, it made the loss NaN once a token reached its expert; merge blamed the adapter.
    model_dir, adapter_dir = adapter
    other = tmp_path / "damaged"
    shutil.copytree(model_dir, other)
    state = load_file(other / "model.safetensors")
    key = "model.layers.1.mlp.experts.2.down_proj.weight"
    state[key][0, 0] = float("nan")
    save_file(state, other / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{re.escape(key)} holds NaN or Inf in the model's checkpoint"):
        run(["merge", str(other), str(adapter_dir), str(tmp_path / "merged")])
    assert run(["prepare", str(other), str(tmp_path / "prepared")]) == 0  # prepare reads no weight
    with pytest.raises(ValueError, match="layer 1's routed experts: expert 2's down weights hold NaN or Inf"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "prepared", trust_remote_code=True)


def test_an_index_that_leaves_out_an_expert_key_its_shard_holds_is_named(adapter, tmp_path):
    # The refusal blamed config.json, where the index is the stale file.
    model_dir, _ = adapter
    other = indexed_copy(model_dir, tmp_path, "model-00001-of-00001.safetensors")
    index = json.loads((other / "model.safetensors.index.json").read_text())
    key = "model.layers.0.mlp.experts.1.up_proj.weight"
    del index["weight_map"][key]
    (other / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"index does not list {re.escape(key)}, which model-00001-of-00001"):
        run(["prepare", str(other), str(tmp_path / "out")])


def test_a_broken_link_for_the_weights_is_named(adapter, tmp_path):
    # A Hugging Face cache's model.safetensors is a link to a blob: one deleted or never finished was reported as a
    # directory without weights.
    model_dir, _ = adapter
    other = tmp_path / "snapshot"
    shutil.copytree(model_dir, other)
    (other / "model.safetensors").unlink()
    (other / "model.safetensors").symlink_to(tmp_path / "blobs" / "0123abcd")
    with pytest.raises(FileNotFoundError, match="is a link to .*0123abcd, which does not exist"):
        run(["prepare", str(other), str(tmp_path / "out")])
    sharded = indexed_copy(model_dir, tmp_path, "model-00001-of-00001.safetensors")
    (sharded / "model.safetensors.index.json").unlink()
    (sharded / "model.safetensors.index.json").symlink_to(tmp_path / "blobs" / "4567ef")
    with pytest.raises(FileNotFoundError, match="index.json is a link to .*4567ef, which does not exist"):
        run(["prepare", str(sharded), str(tmp_path / "out")])


def test_merge_writes_shards_that_sit_in_a_subdirectory(adapter, tmp_path):
    model_dir, adapter_dir = adapter
    other = indexed_copy(model_dir, tmp_path, "weights/model.safetensors")
    assert run(["merge", str(other), str(adapter_dir), str(tmp_path / "out")]) == 0
    merged = load_file(tmp_path / "out" / "weights" / "model.safetensors")
    plain = load_file(model_dir / "model.safetensors")
    assert merged.keys() == plain.keys() and any(not torch.equal(merged[k], plain[k]) for k in plain)


@pytest.mark.parametrize("file, text, message", [
    ("config.json", "[1, 2]", "holds a JSON list, not a model configuration"),
    ("config.json", "{\"model_type\": ", "is not valid JSON"),
    ("model.safetensors.index.json", "{\"metadata\": {}}", "has no weight_map of tensor names to shard files"),
    ("model.safetensors.index.json", "[]", "is not a safetensors index"),
], ids=["config_list", "config_cut", "index_without_map", "index_list"])
@pytest.mark.parametrize("command", ["merge", "prepare"])
def test_a_broken_model_config_or_index_is_named(adapter, tmp_path, file, text, message, command):
    model_dir, adapter_dir = adapter
    other = tmp_path / "broken"
    shutil.copytree(model_dir, other)
    if file.endswith(".index.json"):  # sharded: a model.safetensors would be read instead of any index
        (other / "model.safetensors").rename(other / "model-00001-of-00001.safetensors")
    (other / file).write_text(text)
    args = [str(other), str(adapter_dir)] if command == "merge" else [str(other)]
    with pytest.raises(ValueError, match=message):
        run([command, *args, str(tmp_path / "out")])


def edited_model(model_dir, tmp_path, **changes):
    other = tmp_path / "edited_model"
    shutil.copytree(model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, **changes}))
    return other


@pytest.mark.parametrize("changes, extra, message", [
    ({}, ["--kernels", "bogus"], r"--kernels 'bogus' is not one of amx, "),
    ({"num_experts_per_tok": 99}, [], r"num_experts_per_tok = 99 of 8 experts; it must be 1 to 8"),
    ({"num_local_experts": 4}, [], r"has model.layers.0.mlp.experts.4.gate_proj.weight, an expert past the 4"),
    ({"hidden_size": "64"}, [], r"config.json is not a valid qwen3_moe configuration \(.*hidden_size"),
    ({"vocab_size": -1}, [], r"config.json describes no buildable qwen3_moe model \(.*negative dimension"),
    ({"num_attention_heads": 0}, [], r"config.json describes no buildable qwen3_moe model \(.*by zero"),
    # Had been prepared, and loaded with nothing on the CPU engine.
    ({"mlp_only_layers": list(range(8))}, [], r"makes every layer a dense MLP \(no routed experts\)"),
    # The rest had been prepared, and refused by the load only after it had read every weight outside the experts.
    ({"vocab_size": 128}, [], r"lm_head.weight has shape \[96, 64\] but config.json implies \[128, 64\]"),
    ({"num_attention_heads": 8}, [], r"self_attn.o_proj.weight has shape \[\d+, \d+\] but config.json implies"),
    ({"mlp_only_layers": [0]}, [], r"has model.layers.0.mlp.experts.0.down_proj.weight and \d+ more, which no weight of "
                                   r"the qwen3_moe model that config.json describes matches; check .* mlp_only_layers"),
    ({"num_hidden_layers": 3, "mlp_only_layers": [2]}, [], r"lacks model.layers.2.\S+ and \d+ more, which the "
                                                           r"qwen3_moe model that config.json describes needs; download"),
], ids=["kernels", "top_k", "fewer_experts", "string_size", "negative_vocab", "no_heads", "all_dense", "other_vocab",
        "other_heads", "a_dense_layer", "a_dense_layer_more"])
def test_prepare_refuses_settings_the_load_would_fail_on(adapter, tmp_path, changes, extra, message):
    model_dir, _ = adapter
    with pytest.raises(ValueError, match=message):
        run(["prepare", str(edited_model(model_dir, tmp_path, **changes)), str(tmp_path / "out"), *extra])
    assert not (tmp_path / "out").exists()


def test_a_model_without_routed_experts_is_named_in_memory_too():
    config = CONFIGS["qwen3_moe"]()
    config.mlp_only_layers = list(range(config.num_hidden_layers))
    with pytest.raises(ValueError, match="makes every layer a dense MLP"):  # had blamed the transformers version
        use_cpu_experts(transformers.AutoModelForCausalLM.from_config(config))


def test_prepare_refuses_a_model_without_a_tokenizer(adapter, tmp_path):
    # LLaMA-Factory reads the tokenizer from the prepared directory; with none, transformers made one of a single
    # token and training ran to the end on input_ids [1, 1, 1].
    model_dir, _ = adapter
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    (bare / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no tokenizer .* copy the published model's tokenizer files"):
        run(["prepare", str(bare), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    (bare / "tiktoken.model").write_text("")  # Kimi-K2's
    assert run(["prepare", str(bare), str(tmp_path / "out")]) == 0


def test_prepare_again_drops_the_earlier_models_links_and_keeps_files_of_its_own(adapter, tmp_path):
    model_dir, _ = adapter
    first = tmp_path / "first"
    shutil.copytree(model_dir, first)
    (first / "tokenizer.json").write_text("{}")
    (first / "original").mkdir()  # a subdirectory: linked
    out = tmp_path / "prepared"
    assert run(["prepare", str(first), str(out)]) == 0 and (out / "tokenizer.json").read_text() == "{}"
    assert (out / "original").is_symlink()
    (out / "chat_template.jinja").symlink_to(tmp_path / "my_template.jinja")  # the user's own link
    assert run(["prepare", str(model_dir), str(out)]) == 0
    # The first model's tokenizer and directory do not stay beside the second's weights.
    assert not (out / "tokenizer.json").exists() and not (out / "original").exists()
    assert (out / "chat_template.jinja").is_symlink()
    (out / "generation_config.json").write_text("{\"edited\": true}")
    with pytest.raises(FileExistsError, match="generation_config.json is a file of its own where prepare puts"):
        run(["prepare", str(model_dir), str(out)])
    assert json.loads((out / "generation_config.json").read_text()) == {"edited": True}
    # A prepare cut short records no copies: those still equal to the source's are its own, and one cut short mid-copy
    # is under a name of its own (it had been the file's, then refused as the user's).
    (out / "generation_config.json").write_text((model_dir / "generation_config.json").read_text())
    (out / "config.json").unlink()
    (out / ".tokenizer_config.json.copying").write_text("{")
    assert run(["prepare", str(model_dir), str(out)]) == 0
    assert not (out / ".tokenizer_config.json.copying").exists()


def test_merge_leaves_an_existing_merging_directory_alone(adapter, tmp_path):
    model_dir, adapter_dir = adapter
    (tmp_path / ".out.merging").mkdir()
    (tmp_path / ".out.merging" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"\.out\.merging exists \(left by an interrupted merge\?\); delete it"):
        run(["merge", str(model_dir), str(adapter_dir), str(tmp_path / "out")])
    assert (tmp_path / ".out.merging" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("setting, message", [
    ("KT_SFT_THREADS=abc", "KT_SFT_THREADS='abc' is not a whole number"),
    ("KT_SFT_KERNELS=bogus", "KT_SFT_KERNELS='bogus': Kernel set 'bogus' cannot run on this CPU"),
    ("KT_SFT_BACKWARD_COPY=yes", "KT_SFT_BACKWARD_COPY='yes' is neither 0 nor 1"),
    ("KT_SFT_RECOMPUTE_EXPERTS=true", "KT_SFT_RECOMPUTE_EXPERTS='true' is neither 0 nor 1"),
    ("KT_SFT_LORA_ON_GPU=on", "KT_SFT_LORA_ON_GPU='on' is neither 0 nor 1"),
    ("KT_SFT_PIN=false", "KT_SFT_PIN='false' is neither 0 nor 1"),
])
def test_a_bad_engine_setting_is_reported_not_raised_at_import(setting, message):
    # Raised at import, it took every kt-sft command down with a traceback, doctor (which should report it) too.
    name, _, value = setting.partition("=")
    env = {**os.environ, name: value}
    doctor = subprocess.run([sys.executable, "-m", "kt_sft.cli", "doctor"], env=env, capture_output=True, text=True)
    assert doctor.returncode == 1 and f"settings         : {message}" in doctor.stdout
    assert "Traceback" not in doctor.stderr
    experts = subprocess.run([sys.executable, "-c", "import torch, kt_sft; "
                              "kt_sft.KTExperts(torch.zeros(2, 8, 4, dtype=torch.bfloat16), "
                              "torch.zeros(2, 4, 4, dtype=torch.bfloat16))"], env=env, capture_output=True, text=True)
    assert experts.returncode == 1 and message in experts.stderr.splitlines()[-1]


@pytest.mark.parametrize("command", ["prepare", "merge", "demo"])
def test_a_loop_of_symbolic_links_is_named(adapter, tmp_path, command):
    model_dir, adapter_dir = adapter
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    args = {"prepare": [str(model_dir)], "merge": [str(model_dir), str(adapter_dir)], "demo": []}[command]
    with pytest.raises(ValueError, match="loop1 is a loop of symbolic links; give a real directory"):
        run([command, *args, str(tmp_path / "loop1")])


@pytest.mark.parametrize("command", ["export", "merge"])
def test_a_failed_write_is_named(adapter, tmp_path, monkeypatch, command):
    # safetensors' own error (a read-only directory, a full disk) came with a traceback and named no file.
    from safetensors import SafetensorError
    import kt_sft.loader.checkpoint as checkpoint

    def refuse(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 13, kind: PermissionDenied })")
    monkeypatch.setattr(checkpoint, "save_file", refuse)
    model_dir, adapter_dir = adapter
    args = [str(model_dir), str(adapter_dir)] if command == "merge" else [str(adapter_dir)]
    extra = ["--model", str(model_dir)] if command == "export" else []
    assert main([command, *args, str(tmp_path / "out"), *extra]) == 2
    with pytest.raises(OSError, match=r"cannot write .*safetensors \(Error while serializing.*check the directory's"):
        run([command, *args, str(tmp_path / "out2"), *extra])


@pytest.mark.parametrize("command", ["export", "merge"])
def test_a_model_of_another_architecture_than_the_adapters_is_refused(adapter, tmp_path, command):
    # With matching shapes, the adapter's LoRA was written under the other architecture's names.
    model_dir, adapter_dir = adapter
    other = with_config(adapter_dir, tmp_path, config_with(adapter_dir, base_model_name_or_path=str(model_dir)))
    mixtral = tmp_path / "mixtral"
    save_checkpoint(tiny_model("mixtral"), mixtral)
    if command == "export":
        assert run(["export", str(other), str(tmp_path / "same"), "--model", str(model_dir)]) == 0
        args, given = [str(other), str(tmp_path / "out"), "--model", str(mixtral)], "--model .*mixtral"
    else:
        args, given = [str(mixtral), str(other), str(tmp_path / "out")], ".*mixtral"
    with pytest.raises(ValueError, match=rf"a qwen3_moe model, but {given} is a mixtral model; {command} it"):
        run([command, *args])
    assert not (tmp_path / "out").exists()


def test_merge_checks_every_shard_against_its_index_before_writing(adapter, tmp_path):
    # A tensor the index puts in a shard that lacks it had surfaced as safetensors' traceback mid-merge; a tensor a
    # shard holds but the index omits is copied like the others.
    model_dir, adapter_dir = adapter
    other = indexed_copy(model_dir, tmp_path, "model-00001-of-00001.safetensors")
    state = load_file(other / "model-00001-of-00001.safetensors")
    save_file({**state, "extra.weight": torch.ones(2)}, other / "model-00001-of-00001.safetensors",
              metadata={"format": "pt"})
    assert run(["merge", str(other), str(adapter_dir), str(tmp_path / "out")]) == 0
    assert torch.equal(load_file(tmp_path / "out" / "model-00001-of-00001.safetensors")["extra.weight"], torch.ones(2))
    index = json.loads((other / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.bias"] = "model-00001-of-00001.safetensors"
    (other / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="index puts model.norm.bias in model-00001-of-00001.safetensors, which does "
                                         "not hold it"):
        run(["merge", str(other), str(adapter_dir), str(tmp_path / "out2")])
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize("size", [2, 100])
def test_merge_names_a_shard_cut_short(adapter, tmp_path, size):
    # Indexed: the merge reads the shard's header itself (for the dtypes), where a cut one had raised struct.error.
    model_dir, adapter_dir = adapter
    other = indexed_copy(model_dir, tmp_path, "model-00001-of-00001.safetensors")
    shard = other / "model-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:size])
    with pytest.raises(ValueError, match="model-00001-of-00001.safetensors is not a readable safetensors file"):
        run(["merge", str(other), str(adapter_dir), str(tmp_path / "out")])


def test_demo_never_writes_into_a_directory_that_holds_something(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="exists and is not empty; choose a new directory for the demo"):
        run(["demo", str(tmp_path)])
    assert [p.name for p in tmp_path.rglob("*")] == ["model", "config.json"]


def test_an_adapter_saved_as_a_pickle_is_named(adapter, tmp_path):
    model_dir, adapter_dir = adapter
    other = tmp_path / "pickled"
    shutil.copytree(adapter_dir, other)
    (other / "adapter_model.safetensors").rename(other / "adapter_model.bin")
    with pytest.raises(FileNotFoundError, match="holds adapter_model.bin, a pickle .* safe_serialization=True"):
        run(["merge", str(model_dir), str(other), str(tmp_path / "out")])


@pytest.mark.parametrize("model_type", [["qwen3_moe"], None])
@pytest.mark.parametrize("command", ["export", "merge"])
def test_a_model_type_that_is_not_a_name_is_named(adapter, tmp_path, model_type, command):
    model_dir, adapter_dir = adapter
    other = edited_model(model_dir, tmp_path, model_type=model_type)
    args = ([str(adapter_dir), str(tmp_path / "out"), "--model", str(other)] if command == "export"
            else [str(other), str(adapter_dir), str(tmp_path / "out")])
    with pytest.raises(ValueError, match=r"config.json gives model_type = .*; it must be a name such as"):
        run([command, *args])


def test_an_interrupted_command_says_so_without_a_traceback(adapter, tmp_path, monkeypatch, capsys):
    import kt_sft.integrations.merge as merge

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(merge, "write_safetensors", interrupt)
    model_dir, adapter_dir = adapter
    assert main(["merge", str(model_dir), str(adapter_dir), str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err.startswith("kt-sft: interrupted;")
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.merging").exists()
