"""`kt-sft export <adapter-dir> <out-dir>`: a trained adapter in the layout PEFT gives adapters on per-expert
modules (transformers 4.x MoE blocks), for runtimes that take LoRA per expert, instead of kt_sft's stacked one.

kt_sft saves expert LoRA stacked per layer and projection (`…mlp.experts.lora_A.gate` [E, r, H], `…lora_B.gate`
[E, I, r]). The per-expert layout names each expert's projection as the published checkpoint does and gives it a
plain LoRA pair: `…mlp.experts.{e}.gate_proj.lora_A.weight` [r, H] and `….lora_B.weight` [I, r] (Mixtral:
`…block_sparse_moe.experts.{e}.w1…`, w3 for up, w2 for down). Every other tensor (attention, shared experts) is
copied as it is; adapter_config.json names the projections instead of `experts`. The values are the same numbers:
each expert's update is unchanged, so nothing is lost and nothing is merged. (Merged full weights:
`llamafactory-cli export`, README "Merging".) Like `kt-sft merge`, it writes into a temporary directory beside
out-dir and renames it at the end, so a failure leaves no half-written adapter.
"""
from __future__ import annotations

import json
import math
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from ..loader.checkpoint import open_safetensors, write_safetensors
from ..models import architecture_of, canonical_model_type, composite_of
from ..ops.reference import PROJECTIONS
from .modeling import SETTINGS_KEY

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# The name of the module a plain LoRA matrix (a linear layer's, or an embedding's) belongs to, as target_modules
# lists it.
_LORA_LEAF = re.compile(r".*\.(?P<leaf>[^.]+)\.lora_(?:embedding_)?[AB](?:\.weight)?$")
# A stacked expert LoRA tensor: whatever precedes the model's layers (PEFT's `base_model.model.`), the layer (an
# image-text model's text layers: model.language_model.layers.N, Llama 4's language_model.model.layers.N), the
# experts module inside it, A or B, and the projection.
STACKED_KEY = re.compile(r"^(?P<pre>.*?)(?:language_model\.model\.|model\.(?:language_model\.)?)"
                         r"layers\.(?P<layer>\d+)\..*experts\.lora_(?P<ab>[AB])\.(?P<proj>gate|up|down)$")
# Any other LoRA tensor of a PEFT save: its module path between PEFT's prefix and the LoRA's own names.
_PLAIN_LORA = re.compile(r"^(?P<pre>base_model\.model\.)(?P<module>.+?)(?P<rest>\.lora_.*)$")


def json_object(path: Path, damaged: str, kind: str) -> dict:
    """The JSON object in `path`, or one sentence: not JSON (`damaged` says why that happens), or not an object."""
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); {damaged}.") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not {kind}.")
    return value


def adapter_config(adapter_dir: Path) -> dict:
    """The adapter_config.json of a saved PEFT adapter, checked: both of its files present, a JSON object, a
    positive integer rank and a finite alpha; rank_pattern / alpha_pattern given as null read as empty."""
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (adapter_dir / name).exists():
            if name == ADAPTER_WEIGHTS and (adapter_dir / "adapter_model.bin").exists():
                raise FileNotFoundError(f"{adapter_dir} holds adapter_model.bin, a pickle that kt-sft does not read; "
                                        "save the adapter again with safe_serialization=True (PEFT's default).")
            raise FileNotFoundError(f"{adapter_dir} has no {name}; point at a saved PEFT adapter (the training run's "
                                    "output_dir or one of its checkpoints).")
    path = adapter_dir / ADAPTER_CONFIG
    config = json_object(path, "the adapter was not saved completely", "an adapter configuration")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{path} gives r = {r!r}; a LoRA adapter's rank is a positive integer.")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"{path} gives lora_alpha = {alpha!r}; it must be a finite number.")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key) is None:
            config[key] = {}
        elif not isinstance(config[key], dict):
            raise ValueError(f"{path} gives {key} = {config[key]!r}; PEFT saves it as an object.")
    return config


def read_config(model_dir: Path) -> dict:
    """model_dir's config.json, checked to be a JSON object."""
    return json_object(Path(model_dir) / "config.json", "the download is incomplete or damaged",
                       "a model configuration")


def text_config(config: dict, config_dir: Path) -> dict:
    """A config.json's served model: the config itself, or a composite's part (Kimi-K2.5's text_config, Qwen3-Omni's
    thinker_config)."""
    if not isinstance(config.get("model_type"), str):
        raise ValueError(f"{config_dir}/config.json gives model_type = {config.get('model_type')!r}; it must be a "
                         "name such as \"qwen3_moe\": the file was edited or is not a model's.")
    composite = composite_of(config.get("model_type"))
    if composite is None:
        return config
    if not isinstance(config.get(composite.config_key), dict):
        raise ValueError(f"{config_dir}/config.json declares model_type {config.get('model_type')!r} but has no "
                         f"{composite.config_key}; the download is incomplete or not that model.")
    return config[composite.config_key]


def resolved(path: str | Path) -> Path:
    """path made absolute with its links followed; a link loop said in one sentence (Python before 3.13 raises
    RuntimeError for it, 3.13 returns the link unresolved)."""
    try:
        out = Path(path).resolve()
    except RuntimeError:
        out = Path(path)
    if out.is_symlink():
        raise ValueError(f"{path} is a loop of symbolic links; give a real directory.")
    return out


def require_new_dir(out_dir: Path, what: str) -> None:
    """out_dir may be written: missing, or an empty directory (never over what a user saved there)."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} exists and is not empty; choose a new directory for {what}.")


@contextmanager
def written_beside(out_dir: Path, command: str, suffix: str):
    """A new directory beside out_dir (`.<name>.<suffix>`) to write into: renamed to out_dir when the block ends,
    deleted when it fails or is interrupted, so a failure leaves no half-written output for a rerun to refuse.
    out_dir must be resolved (".": no name to put the directory beside). A system error (a full disk,
    permissions) is said in one sentence naming out_dir; kt_sft's own OSErrors (write_safetensors') are sentences
    already and pass as they are."""
    tmp = out_dir.parent / f".{out_dir.name}.{suffix}"
    if tmp.exists() or tmp.is_symlink():  # a killed run leaves it; never delete what might be a user's
        raise FileExistsError(f"{tmp} exists (left by an interrupted {command}?); delete it, then run the {command} "
                              "again.")
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out_dir.exists():
            out_dir.rmdir()
        tmp.rename(out_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.strerror:
            cause = f"{e.strerror}: {e.filename}" if e.filename else e.strerror
            raise OSError(f"the {command} to {out_dir} failed ({cause}) and its partial output was removed; fix that "
                          "(free space, permissions) and run it again.") from None
        raise


def prepared_settings(model_dir: Path, config: dict) -> dict | None:
    """The settings section of model_dir's config.json (`config`) where model_dir is a `kt-sft prepare` directory,
    else None."""
    # A prepared directory holds no weights and points at its source; a model saved from a kt_sft-loaded one (a
    # full fine-tune, an export) keeps the settings section beside weights of its own, which are the ones it describes.
    own = (model_dir / "model.safetensors").exists() or (model_dir / "model.safetensors.index.json").exists()
    settings = None if own else config.get(SETTINGS_KEY)
    if settings is not None and not (isinstance(settings, dict) and isinstance(settings.get("source"), str)):
        raise ValueError(f"{model_dir}/config.json has a {SETTINGS_KEY!r} section that names no source checkpoint; "
                         "pass the published checkpoint itself.")
    return settings


def text_model_type(config: dict, config_dir: Path) -> str:
    """The canonical model_type of a config's text model."""
    return canonical_model_type(text_config(config, config_dir).get("model_type"))


def base_config(adapter_dir: Path, config: dict, model_dir: str | Path | None) -> tuple[Path, dict]:
    """(directory, config.json) of the model the adapter was trained on: model_dir, else the adapter's
    base_model_name_or_path (never the current directory when that is empty)."""
    recorded = recorded_base(config)
    base = model_dir or recorded
    if not base or not (Path(base) / "config.json").exists():
        looked = f" (looked in '{base}')" if base else " (its base_model_name_or_path is empty)"
        raise FileNotFoundError(f"cannot find the config.json of the model {adapter_dir} was trained on{looked}; pass "
                                "the model directory with --model.")
    model = read_config(Path(base))
    if model_dir:
        check_trained_on(adapter_dir, config, text_model_type(model, Path(base)), f"--model {model_dir}", "export")
    return Path(base), model


def recorded_base(config: dict) -> str | None:
    """The adapter's base_model_name_or_path, where it names a path."""
    recorded = config.get("base_model_name_or_path")
    return recorded if isinstance(recorded, str) and recorded else None


def check_trained_on(adapter_dir: Path, config: dict, model_type: str, given: str, command: str) -> None:
    """Refuses a model of another architecture than the one the adapter records as its base, where that base is at
    hand: with the same shapes its LoRA would be written under the other architecture's names without a word."""
    recorded = recorded_base(config)
    if recorded is None or not (Path(recorded) / "config.json").is_file():
        return
    trained = text_model_type(read_config(Path(recorded)), Path(recorded))
    if trained != model_type:
        raise ValueError(f"{adapter_dir} was trained on {recorded}, a {trained} model, but {given} is a {model_type} "
                         f"model; {command} it with the model it was trained on.")


def expert_sizes(model: dict) -> tuple:
    """(experts per layer, hidden size, the experts' intermediate size) from a model's config.json (its text model's,
    whichever of the architectures' names it uses; None where it gives none)."""
    text = model.get("text_config") or model
    experts = next((text[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in text), None)
    # The experts' own width: Mixtral names it intermediate_size, LongCat-Flash expert_ffn_hidden_size, the others
    # (whose intermediate_size is their dense layers') moe_intermediate_size.
    width = next((text[k] for k in ("moe_intermediate_size", "expert_ffn_hidden_size") if k in text),
                 text.get("intermediate_size"))
    # Nemotron-H's experts run in moe_latent_size where its config gives one.
    return experts, text.get("moe_latent_size") or text.get("hidden_size"), width


def check_stacked(m: re.Match, t, model: dict, r: int, arch) -> None:
    """A stacked expert LoRA tensor (m: its STACKED_KEY match), [E, r, in] (A) or [E, out, r] (B), against the
    adapter's rank, the model's expert count and hidden size (whichever of the architectures' names the config
    uses) and the projections its experts have (arch's)."""
    if t.dim() != 3 or t.shape[1 if m["ab"] == "A" else 2] != r:
        raise ValueError(f"the adapter's {m.string} is shaped {list(t.shape)}, not a rank-{r} stack of expert LoRA "
                         f"matrices ({'[E, r, in]' if m['ab'] == 'A' else '[E, out, r]'}) as its adapter_config.json "
                         "says; the file and the config do not belong together.")
    experts, H, I = expert_sizes(model)
    proj, ab = m["proj"], m["ab"]
    if proj not in (PROJECTIONS[p] for p in arch.projections):
        raise ValueError(f"the adapter's {m.string} is LoRA on the experts' {proj}, which {arch.model_type}'s experts "
                         "do not have (up and down only); export it with the model it was trained on (--model).")
    width = t.shape[2] if ab == "A" else t.shape[1]
    # A of gate/up and B of down meet H; B of gate/up and A of down meet I.
    size, name = (H, "hidden") if (proj == "down") == (ab == "B") else (I, "intermediate")
    if (experts is not None and t.shape[0] != experts) or (size is not None and width != size):
        raise ValueError(f"the adapter's {m.string} is shaped {list(t.shape)} (experts first), but the model has {experts} "
                         f"experts of {name} size {size}; export it with the model it was trained on (--model).")


def export_adapter(adapter_dir: str | Path, out_dir: str | Path, model_dir: str | Path | None = None) -> Path:
    """Writes out_dir/adapter_config.json and out_dir/adapter_model.safetensors in the per-expert layout."""
    adapter_dir, out_dir = Path(adapter_dir), resolved(out_dir)
    config = adapter_config(adapter_dir)
    require_new_dir(out_dir, "the per-expert adapter (writing over a saved adapter would lose it)")
    base, model = base_config(adapter_dir, config, model_dir)
    settings = prepared_settings(base, model)
    # A prepared directory's config.json is the model it serves, and the adapter names that model's modules: a
    # composite's part (refused, by the checkpoint's model_type, where no runtime builds that part's per-expert
    # modules: Kimi-K2.5's text model), or the text model of a Qwen3.5-MoE that an earlier kt_sft prepared. A
    # published composite's config.json nests that part's.
    source_type = settings.get("source_model_type") if settings else model.get("model_type")
    composite = composite_of(source_type)
    if composite is not None and not composite.per_expert_export:
        raise ValueError(f"{source_type} is a composite checkpoint; its per-expert adapter layout is not defined by "
                         "any runtime kt_sft knows, so the per-expert export is not supported for it.")
    model = text_config(model, base)
    arch = architecture_of(SimpleNamespace(model_type=canonical_model_type(model.get("model_type"))))
    if arch.gate_up_interleaved or arch.restructure is not None:  # GPT-OSS; Granite's input_linear, output_linear
        raise ValueError(f"{arch.model_type}'s experts exist only fused in its checkpoints and runtimes, so no runtime "
                         "has the per-expert modules this export would name; serve the adapter with kt_sft, or merge "
                         "it into a BF16 model (`kt-sft merge`, or merge_and_unload and save_pretrained).")
    targets = config.get("target_modules")
    if not isinstance(targets, (list, str)):
        raise ValueError(f"adapter_config.json's target_modules is {targets!r}; PEFT saves a list of module names or "
                         "a regular expression there: save the adapter again with PEFT.")
    if any("experts" in k for k in (*config.get("rank_pattern", {}), *config.get("alpha_pattern", {}))):
        raise ValueError("rank_pattern / alpha_pattern entries for the experts have no per-expert equivalent here; "
                         "export an adapter trained with one rank and alpha on the experts.")
    out, stacked = {}, 0
    with open_safetensors(adapter_dir / ADAPTER_WEIGHTS) as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    # The other LoRA goes under the checkpoint's names too where the architecture's renames carry the experts' module
    # path to their checkpoint keys (Nemotron-H's backbone., Mixtral's router under block_sparse_moe): one module
    # tree's names throughout. Not where its experts are named otherwise (Qwen3.5-MoE's text model saved alone).
    experts_at = arch.experts_prefix(0)
    renamed = arch.checkpoint_name(arch.module_key(experts_at)) == experts_at
    for key, t in tensors.items():
        m = STACKED_KEY.match(key)
        if m is None:
            plain = _PLAIN_LORA.match(key) if renamed else None
            out[f"{plain['pre']}{arch.checkpoint_name(plain['module'])}{plain['rest']}" if plain else key] = t
            continue
        stacked += 1
        check_stacked(m, t, model, config["r"], arch)
        proj = PROJECTIONS.index(m["proj"])
        for e in range(t.shape[0]):
            out[f"{m['pre']}{arch.expert_module(int(m['layer']), e, proj)}.lora_{m['ab']}.weight"] = t[e].contiguous()
    if not stacked:
        raise ValueError(f"{adapter_dir} holds no expert LoRA (no `…experts.lora_A.gate`-style tensors); it needs no "
                         "per-expert export.")
    held = {m["leaf"] for m in map(_LORA_LEAF.match, out) if m}
    if isinstance(targets, str):  # a regular expression over module paths: it would match no per-expert module,
        # so the list of what the adapter holds takes its place
        targets = sorted(held)
    # Targets that hold no LoRA in the file go: LLaMA-Factory names an image-text model's targets by path, every
    # module whose path contains a target name, which also named modules LoRA has no form for (an activation, the
    # LoRA layers' own children), and stock PEFT refuses those.
    kept = [k for k in targets if not k.endswith("experts") and k.rsplit(".", 1)[-1] in held]
    config["target_modules"] = sorted({*kept, *(arch.checkpoint_projections[p] for p in arch.projections)})
    with written_beside(out_dir, "export", "exporting") as tmp:
        write_safetensors(out, tmp / ADAPTER_WEIGHTS, {"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
