"""Supported MoE architectures, as data (STYLE.md 8): one small file per architecture registers itself here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..nn.stock_layout import StockLayout
from ..ops.reference import SWIGLU, Glu


# Classes other libraries put in place of an architecture's experts class, with its weights' layout and its call:
# Liger Kernel's (LLaMA-Factory's enable_liger_kernel swaps it in for the experts of the MoE models it patches).
STAND_IN_EXPERTS = ("LigerExperts",)


@dataclass(frozen=True)
class MoEArchitecture:
    model_type: str
    # transformers 5.x experts classes this architecture's MoE blocks hold (names changed at 5.13:
    # `*NaiveMoe` became `*Experts`); each has gate_up_proj [E,2I,H], down_proj [E,H,I] and the call
    # forward(hidden_states, top_k_index, top_k_weights).
    experts_classes: tuple[str, ...]
    # Where a checkpoint on disk keeps expert e of layer L (per-expert 2-D tensors, as published and as
    # transformers saves them), and the names of its gate, up and down projections (gate's None for experts without
    # one: the unit's `gated`).
    checkpoint_experts: str = "model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"
    checkpoint_projections: tuple[str | None, str, str] = ("gate_proj", "up_proj", "down_proj")
    # Checkpoint key fragments that the transformers module tree names differently (old, new); an old one that starts
    # with "^" is a prefix of the key only (InternVL's `vision_tower.` is the module's `model.vision_tower.`, whose own
    # name holds it).
    key_renames: tuple[tuple[str, str], ...] = ()
    # The MoE block's attribute holding shared experts that its stock forward applies to the block's input after
    # the routed experts: they run on the GPU meanwhile (models/overlap.py). None: no shared experts, or the block
    # applies them first (Qwen2-MoE, whose router then waits for them on the same stream).
    shared_experts: str | None = None
    # A module of the decoder layer that the layer calls on its MoE block's input right after the block (LongCat-
    # Flash's first dense MLP, mlps.0): it runs on the GPU meanwhile too.
    dense_beside: str | None = None
    # Whether the checkpoint stores a layer's experts fused and transposed from the module's layout: gate_up_proj
    # [E, H, 2I] and down_proj [E, I, H] (Qwen3-VL-MoE as published; transformers reads either layout).
    fused_transposed: bool = False
    # The config attribute giving how many zero-computation experts follow the routed ones (LongCat-Flash's
    # zero_expert_num): ids past the routed experts that return the token itself. None: the architecture has none.
    identity_experts: str | None = None
    # Whether the transformers module itself holds the experts transposed from the engine's layout, gate_up_proj
    # [E, H, 2I] and down_proj [E, I, H], as its checkpoints store them (Llama 4); its state dicts keep that layout.
    module_transposed: bool = False
    # A forward put on the MoE blocks whose experts the engine computes, where the stock block does not call them as
    # transformers 5's call does (Llama 4's computes every expert on every token); None: the stock block's.
    block_forward: Callable | None = None
    # Whether the module's (and checkpoint's) gate_up_proj alternates gate's and up's outputs (GPT-OSS).
    gate_up_interleaved: bool = False
    # Whether the experts have gate_up_proj_bias [E, 2I] and down_proj_bias [E, H] (GPT-OSS).
    expert_biases: bool = False
    # The experts' gated unit (ops/reference.py Glu): SwiGLU, GPT-OSS's clamped form, GeGLU (Gemma 4), or relu² of up
    # without a gate (Nemotron-H); the text config's field the stock experts read their activation from, and its
    # values that the unit computes.
    unit: Glu = SWIGLU
    activation_field: str = "hidden_act"
    activations: tuple[str, ...] = ("silu", "swish")
    # The text models (their config's model_type) whose experts the architecture serves, where its model_type wraps
    # several kinds of text model (InternVL: Qwen3-MoE's, not GPT-OSS's nor the dense ones); None: its own.
    text_model_types: tuple[str, ...] | None = None
    # Gives a stock model's MoE blocks an experts module of transformers 5's form (experts_classes), where they hold
    # their experts otherwise (Granite's input_linear and output_linear beside the router); None: they hold one.
    restructure: Callable | None = None

    def experts_in_place(self, model) -> None:
        """Makes a stock model of this architecture hold its experts as experts_classes modules (restructure)."""
        if self.restructure is not None:
            self.restructure(model)

    def stock_layout(self) -> StockLayout:
        """How the stock module holds its fused weights against the engine's layout (nn/stock_layout.py)."""
        return StockLayout(self.module_transposed, self.gate_up_interleaved, self.unit.gated)

    @property
    def projections(self) -> tuple[int, ...]:
        """The experts' projections (0 gate, 1 up, 2 down) that a checkpoint holds: up and down without a gate."""
        return (0, 1, 2) if self.unit.gated else (1, 2)

    def expert_dims(self, module) -> tuple[int, int, int]:
        """(E, I, H) of an experts module of this architecture, from its down_proj (LongCat-Flash's gate_up_proj
        also has rows for its zero-computation experts)."""
        E, a, b = module.down_proj.shape
        return (E, a, b) if self.module_transposed else (E, b, a)

    def identity_count(self, config) -> int:
        """How many zero-computation experts config gives this architecture's MoE blocks (0 where it has none)."""
        return int(getattr(text_config_of(config), self.identity_experts, 0) or 0) if self.identity_experts else 0

    def holds_experts(self, module) -> bool:
        """Whether module is this architecture's experts module, or one another library put in its place."""
        name = type(module).__name__
        return name in self.experts_classes or name in STAND_IN_EXPERTS

    def no_experts_error(self, model) -> ValueError:
        """Why a model of this architecture holds none of its experts modules: its config makes every layer dense
        (qwen*_moe's mlp_only_layers, deepseek's first_k_dense_replace, ...), or its transformers version names
        the experts class differently."""
        if not any(hasattr(m, "experts") for m in model.modules()):  # no MoE block at all
            return ValueError(f"this {self.model_type} config makes every layer a dense MLP (no routed experts), so "
                              "nothing would run on the CPU engine; train it with stock transformers instead.")
        return ValueError(f"no {' / '.join(self.experts_classes)} module found in this {self.model_type} model; its "
                          "transformers version may name the experts class differently.")

    def expert_key(self, layer: int, expert: int, proj: int) -> str:
        return self.checkpoint_experts.format(layer=layer, expert=expert, proj=self.checkpoint_projections[proj])

    def experts_prefix(self, layer: int) -> str:
        """What every checkpoint key of layer's routed experts starts with."""
        return self.checkpoint_experts.split("{expert}")[0].format(layer=layer)

    def expert_module(self, layer: int, expert: int, proj: int) -> str:
        """The module path of expert_key's weight (a per-expert nn.Linear, as PEFT names LoRA on it)."""
        return self.expert_key(layer, expert, proj).removesuffix(".weight")

    def module_key(self, checkpoint_key: str) -> str:
        for old, new in self.key_renames:
            checkpoint_key = _renamed(checkpoint_key, old, new)
        return checkpoint_key

    def checkpoint_name(self, module_path: str) -> str:
        """module_key's way back: the checkpoint's name of a module tree path."""
        for old, new in self.key_renames:
            module_path = _renamed(module_path, "^" + new if old.startswith("^") else new, old.removeprefix("^"))
        return module_path

    def stored_names(self, module_path: str) -> tuple[str, ...]:
        """The names a checkpoint may keep a module tree path under: the checkpoint's (Mixtral's block_sparse_moe,
        Qwen3.5-MoE's model.language_model.), or the module's own where a save keeps those (Qwen3.5-MoE's text model
        saved on its own)."""
        return tuple(dict.fromkeys((self.checkpoint_name(module_path), module_path)))


# The names LLaVA-style image-text checkpoints keep for the module tree's (InternVL3.5's -HF releases, Mistral Small
# 4's: transformers saves them so): key_renames of those architectures.
LLAVA_NAMES = (("^language_model.model.", "model.language_model."), ("^language_model.lm_head.", "lm_head."),
               ("^vision_tower.", "model.vision_tower."), ("^multi_modal_projector.", "model.multi_modal_projector."))


def _renamed(key: str, old: str, new: str) -> str:
    """key with old replaced by new: everywhere, or (old marked "^") where key starts with it, a whole module path
    included (`lm_head` for `lm_head.`)."""
    if not old.startswith("^"):
        return key.replace(old, new)
    dotted = key + "."
    return (new + dotted[len(old) - 1:])[:-1] if dotted.startswith(old[1:]) else key


_REGISTRY: dict[str, MoEArchitecture] = {}
# model_types published with their own remote code that are a registered architecture under another name.
_ALIASES: dict[str, str] = {}


def register(arch: MoEArchitecture) -> MoEArchitecture:
    _REGISTRY[arch.model_type] = arch
    return arch


def register_alias(model_type: str, same_as: str) -> None:
    _ALIASES[model_type] = same_as


# Composite checkpoints whose one part alone is served (its other keys are not read): a text model beside a vision
# tower where transformers has no class for the whole model (Kimi-K2.5), or Qwen3-Omni's thinker (text, images, audio
# and video in, text out) beside the talker and vocoder that speak its answers, which LLaMA-Factory drops after loading
# them. Image-text models that transformers builds whole (Qwen3-VL-MoE, Qwen3.5-MoE) are registered as architectures.
@dataclass(frozen=True)
class Composite:
    weight_prefix: str  # of the served part's weight keys ("language_model.", "thinker.")
    config_key: str = "text_config"  # where config.json nests the served part's config
    # The attribute of transformers' whole model that holds the served part (Qwen3-Omni's `thinker`); None where
    # transformers has no class for the whole model (Kimi-K2.5's is its own remote code).
    attribute: str | None = None
    # Whether a per-expert adapter of the served part names modules that runtimes build (Qwen3-Omni's thinker, as
    # LLaMA-Factory trains it under transformers 4.x); Kimi-K2.5's text model has no such runtime.
    per_expert_export: bool = False


_COMPOSITES: dict[str, Composite] = {}


def register_composite(model_type: str, composite: Composite) -> None:
    _COMPOSITES[model_type] = composite


def composite_of(model_type: str) -> Composite | None:
    """The registered composite that `model_type` names, else None."""
    return _COMPOSITES.get(model_type)


def served_prefix(model_type: str) -> str:
    """The weight-key prefix of the part kt_sft serves of a `model_type` checkpoint: a composite's, else ""."""
    composite = _COMPOSITES.get(model_type)
    return composite.weight_prefix if composite else ""


def canonical_model_type(model_type: str) -> str:
    """The transformers model_type that serves `model_type` (itself unless it is an alias)."""
    return _ALIASES.get(model_type, model_type)


def text_config_of(config):
    """The config of a model's text model: a composite's (Qwen3-VL-MoE's text_config), else the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def architecture_of(config) -> MoEArchitecture:
    model_type = getattr(config, "model_type", None)
    if model_type not in _REGISTRY:
        part = _COMPOSITES[model_type].attribute if model_type in _COMPOSITES else None
        if part is not None:  # transformers' whole model, of which kt_sft serves one part
            raise ValueError(f"kt_sft serves a {model_type} model's {part} alone, not the whole model; run `kt-sft "
                             f"prepare` on its directory and load the prepared one, or give kt_sft the loaded model's "
                             f"`.{part}`.")
        if model_type in _ALIASES or model_type in _COMPOSITES:  # a model built by its own remote code
            raise ValueError(f"this {model_type} model was built by its own remote code, whose modules kt_sft does not "
                             f"replace; run `kt-sft prepare` on its directory, which serves it as "
                             f"{_ALIASES.get(model_type, 'its text model')} with stock transformers.")
        raise ValueError(f"model_type {model_type!r} is not supported by kt_sft; supported: "
                         f"{', '.join(sorted([*_REGISTRY, *_ALIASES, *_COMPOSITES]))}.")
    arch = _REGISTRY[model_type]
    text = text_config_of(config)
    text_type = getattr(text, "model_type", None)
    # kt-sft merge and export look the architecture up by model_type alone (no text config to check).
    if arch.text_model_types is not None and text is not config and text_type not in arch.text_model_types:
        raise ValueError(f"this {model_type} model's text model is {text_type}; kt_sft serves {model_type} with a "
                         f"{' or '.join(arch.text_model_types)} text model only (a dense one has no routed experts, "
                         "and others' experts are of another kind): train this one with stock transformers.")
    # Checked here so that loading a checkpoint refuses it too, not only patching; a config that names no activation
    # (kt-sft merge and export look the architecture up by model_type alone) is not checked.
    act = getattr(text, arch.activation_field, None)
    if act is not None and act not in arch.activations:
        raise ValueError(f"{model_type} uses {arch.activation_field}={act!r}; the CPU experts compute {model_type}'s "
                         f"experts with {' or '.join(arch.activations)} only, so kt_sft cannot train this model: use "
                         "one whose experts use that.")
    if model_type == "deepseek_v2" and getattr(config, "topk_method", None) == "group_limited_greedy":
        # transformers 5.6's DeepseekV2Moe reads self.num_experts on that path, which it never sets: the stock model
        # fails at its first forward too.
        raise ValueError("DeepSeek-V2 with topk_method 'group_limited_greedy' (the full model's routing) fails in "
                         "transformers' DeepseekV2Moe (AttributeError: no num_experts), stock model included; "
                         "kt_sft cannot serve it until transformers does (DeepSeek-V2-Lite's 'greedy' works).")
    return arch
