"""LoRA through the stock `llamafactory-cli` on quantized checkpoints laid out as published: a tiny DeepSeek-V3 in
FP8 block-128 and in compressed-tensors FP8 with a scale per channel (llm-compressor's FP8_DYNAMIC, as community FP8
releases of GLM and Qwen3 are), a tiny Kimi-K2 in RAWINT4 group-32, and the DeepSeek-V3 in compressed-tensors INT4
of groups of 64 (W4A16 releases). The experts stay quantized in the engine,
the loss falls, and the adapter (expert LoRA included) loads back exactly with PEFT."""
import peft
import pytest
import torch
import transformers
from safetensors import safe_open

from kt_sft.integrations.demo import write_data, write_tokenizer
from kt_sft.integrations.prepare import prepare
from kt_sft.peft.layer import KTExpertsLinear
from quantized_checkpoints import quantize_checkpoint
from test_llamafactory import losses, run, write_yaml


def write_deepseek_v3(out, vocab_size):
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5, q_lora_rank=64,
        kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():  # as in the demo: a wide enough lm_head for LoRA to fit the data
        model.lm_head.weight.normal_(0, 0.15)
    model.to(torch.bfloat16).save_pretrained(out)


def train_lora(prepared, root, out, **changes):
    """`llamafactory-cli train` of a LoRA on every linear module and the experts of `prepared`, 30 epochs over the
    identity data in root/data, into `out`."""
    cfg = {"model_name_or_path": str(prepared), "trust_remote_code": True, "stage": "sft", "do_train": True,
           "finetuning_type": "lora", "lora_target": "all", "lora_rank": 8, "lora_alpha": 16,
           "dataset": "kt_identity", "dataset_dir": str(root / "data"), "template": "qwen", "cutoff_len": 256,
           "overwrite_cache": True, "preprocessing_num_workers": 1, "output_dir": str(out),
           "overwrite_output_dir": True, "logging_steps": 5, "save_steps": 1000, "per_device_train_batch_size": 8,
           "learning_rate": 0.01, "num_train_epochs": 30, "lr_scheduler_type": "constant", "bf16": False,
           "report_to": "none", "seed": 0, **changes}
    (root / "base.yaml").write_text("{}\n")
    run(["train", str(write_yaml(root / f"{out.name}.yaml", root / "base.yaml", **cfg))], root)


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("lfq")
    write_deepseek_v3(root / "bf16", write_tokenizer(root / "bf16"))
    write_data(root / "data")
    return root


@pytest.mark.parametrize("fmt, model_type", [("fp8", "deepseek_v3"), ("fp8-channel", "deepseek_v3"),
                                             ("int4", "kimi_k2"), ("int4-g64", "deepseek_v3")])
def test_lora_on_published_quantized_checkpoint(bf16_model, fmt, model_type):
    root = bf16_model
    prepared = prepare(quantize_checkpoint(root / "bf16", root / fmt, fmt, model_type=model_type), root / f"{fmt}_kt")
    out = root / f"run_{fmt}"
    train_lora(prepared, root, out, lora_dropout=0.05)
    curve = losses(out)
    assert curve[max(curve)] < 0.5 * curve[min(curve)], curve

    model = transformers.AutoModelForCausalLM.from_pretrained(prepared, trust_remote_code=True, dtype=torch.float32)
    experts = [m for m in model.modules() if isinstance(m, KTExpertsLinear)]
    assert experts and all(m.expert_format == fmt.split("-")[0] for m in experts)
    model = peft.PeftModel.from_pretrained(model, str(out))
    loaded = dict(model.named_parameters())
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        expert_keys = [k for k in f.keys() if ".mlp.experts.lora_" in k]
        assert expert_keys
        for k in expert_keys:  # saved as `...experts.lora_A.gate`, loaded as `...experts.lora_A.default.gate`
            name = "base_model.model." + k.removeprefix("base_model.model.").replace(".lora_A.", ".lora_A.default.") \
                .replace(".lora_B.", ".lora_B.default.")
            assert torch.equal(loaded[name].detach(), f.get_tensor(k).to(loaded[name].dtype)), k

    # LLaMA-Factory's chat serves the adapter unmerged on quantized experts (it merges adapters into other models
    # at inference, which FP8/INT4 experts refuse): it loads, answers, and exits cleanly (its daemon generation
    # thread, still releasing tensors as `exit` came, had aborted the process in about one exit of five).
    chat = write_yaml(root / f"chat_{fmt}.yaml", root / "base.yaml", model_name_or_path=str(prepared),
                      adapter_name_or_path=str(out), trust_remote_code=True, template="qwen",
                      finetuning_type="lora", infer_backend="huggingface", do_sample=False, max_new_tokens=8)
    replies = [line for line in run(["chat", str(chat)], root, stdin="Who are you?\nexit\n").splitlines()
               if "Assistant:" in line]
    assert replies and replies[0].split("Assistant:", 1)[1].strip(), replies
