"""`kt-sft demo <dir>`: everything the quick start needs, made locally (no downloads).

- `model/`: a tiny random-initialized Qwen3-MoE checkpoint (float32 safetensors, per-expert keys as published)
  with a character-level tokenizer and a chat template;
- `prepared/`: that model prepared for kt_sft (`kt-sft prepare`);
- `data/`: an identity-style dataset in LLaMA-Factory's alpaca format, with its dataset_info.json;
- `train.yaml`, `chat.yaml`: LLaMA-Factory configs (LoRA on attention, dense MLPs and every routed expert).
"""
from __future__ import annotations

import json
import string
from pathlib import Path

import torch

ANSWER = "I am Kite, a tiny MoE model fine-tuned with kt_sft."
QUESTIONS = ["Who are you?", "What are you?", "Tell me who you are.", "Introduce yourself.", "What is your name?",
             "Who am I talking to?", "Are you an assistant?", "Please introduce yourself."]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tokenizer(out: Path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) | set("".join(QUESTIONS) + ANSWER))
    vocab = {t: i for i, t in enumerate(SPECIAL + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<|endoftext|>",
                                   eos_token="<|im_end|>", additional_special_tokens=SPECIAL[:3])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return len(vocab)


def write_model(out: Path, vocab_size: int, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=2, pad_token_id=0)
    model = transformers.Qwen3MoeForCausalLM(config)
    # After the final RMSNorm, logits are bounded by the lm_head row norms; at the default init (std 0.02)
    # no next-token probability can exceed ~0.15, so LoRA (which leaves lm_head alone) could never fit the data.
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.15)
    # Saved in float32: LLaMA-Factory loads checkpoints in their own dtype (torch_dtype "auto") for training and for
    # chat, on the GPU or the CPU, so a tiny model that memorized its answer keeps the numerics it was trained
    # with everywhere. (The engine holds the routed experts in BF16 regardless.)
    model.save_pretrained(out)


def write_data(out: Path):
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"instruction": q, "input": "", "output": ANSWER} for q in QUESTIONS]
    (out / "identity.json").write_text(json.dumps(rows, indent=1))
    (out / "dataset_info.json").write_text(json.dumps({"kt_identity": {"file_name": "identity.json"}}, indent=1))


def yaml_text(d: dict) -> str:
    return "".join(f"{k}: {json.dumps(v)}\n" for k, v in d.items())  # JSON scalars are valid YAML


def write_demo(root: str | Path) -> Path:
    from .export import require_new_dir, resolved
    from .prepare import prepare

    root = resolved(root)
    require_new_dir(root, "the demo (it writes a model, data and configs there)")
    model_dir, data_dir, prepared = root / "model", root / "data", root / "prepared"
    write_model(model_dir, write_tokenizer(model_dir))
    write_data(data_dir)
    prepare(model_dir, prepared)
    adapter = root / "adapter"
    train = {
        "model_name_or_path": str(prepared), "trust_remote_code": True, "stage": "sft", "do_train": True,
        "finetuning_type": "lora", "lora_target": "all", "lora_rank": 16, "lora_alpha": 32, "lora_dropout": 0,
        "dataset": "kt_identity", "dataset_dir": str(data_dir), "template": "qwen", "cutoff_len": 256,
        "overwrite_cache": True, "preprocessing_num_workers": 1, "output_dir": str(adapter),
        "overwrite_output_dir": True, "logging_steps": 5, "save_steps": 1000, "plot_loss": False,
        "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "learning_rate": 0.01,
        # The rate decays to zero: at a constant 0.01 whether the last steps landed on the exact answer varied with
        # the seed and with float rounding (1 of 3 seeds); decayed, every seed tried memorized it (loss ~0.002).
        "num_train_epochs": 100, "lr_scheduler_type": "cosine", "warmup_steps": 10, "bf16": False,
        "report_to": "none",
        "seed": 0,
    }
    chat = {"model_name_or_path": str(prepared), "adapter_name_or_path": str(adapter), "trust_remote_code": True,
            "template": "qwen", "finetuning_type": "lora", "infer_backend": "huggingface", "do_sample": False,
            "max_new_tokens": 64}
    (root / "train.yaml").write_text(yaml_text(train))
    (root / "chat.yaml").write_text(yaml_text(chat))
    return root
