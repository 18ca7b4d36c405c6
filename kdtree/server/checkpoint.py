"""A tiny random-weight DeepSeek-V3-architecture checkpoint, built offline in seconds, for a real SGLang server.

The attention is the real models': MLA with kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128 and
v_head_dim 128, so the absorbed verify call is q/k 576, v 512, as in Kimi K2.x and DeepSeek-V3. Heads per rank
decide the verify shapes (Kimi K2.x at TP8: 8; DeepSeek-V3 at TP8: 16); layers and hidden size decide how much
of a step is attention. Every layer is dense (`first_k_dense_replace` = layers): no MoE kernels are needed.
The tokenizer is a byte-level BPE trained on the spot on a few sentences, with a chat template, so the OpenAI
endpoints work too. Built with transformers and tokenizers (SGLang's own dependencies).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from kdtree.errors import BadInput

STAMP = "kdtree-checkpoint.json"  # the spec a directory was built from: a matching one is reused

# MLA dims of Kimi K2.x and DeepSeek-V3 (absorbed: q/k 512 + 64 = 576, v 512)
KV_LORA_RANK, QK_ROPE_HEAD_DIM, QK_NOPE_HEAD_DIM, V_HEAD_DIM = 512, 64, 128, 128

# SGLang's DeepSeek loader reads fields transformers' DeepseekV3Config does not define (DeepSeek-V3's own
# config.json carries them); without `moe_layer_freq` the loader fails with an AttributeError.
SGLANG_FIELDS = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "ep_size": 1}

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts a tree of tokens and the target model verifies every node in one pass.",
    "Multi-head latent attention stores one compressed latent per token: 512 values and a 64-wide rotary key.",
    "def verify(tree, prefix):\n    return [node for node in tree if node.accepted]\n",
    "A kernel engineer reads the mask row by row: prefix columns first, then the draft nodes.",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "The server answered every request; the shadow line said rel=1.2e-03 on layer 0.",
    "Kimi K2 and DeepSeek-V3 share the same attention: q and k of 576, v of 512, in bf16.",
]
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]  # ids 0, 1, 2: bos, eos, pad
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class CheckpointError(BadInput):
    """A directory that is not a tiny checkpoint of the asked spec stands where one would be built."""


@dataclass(frozen=True)
class TinySpec:
    """What the tiny model is: heads per TP rank and the TP size it is sharded for, depth, width, context."""

    heads_per_rank: int = 8
    tp: int = 1
    layers: int = 2
    hidden_size: int = 256
    context_length: int = 4096
    vocab: int = 512  # the tokenizer's target vocabulary (byte-level: at least 256 + specials)
    seed: int = 0
    # lm_head's initial weights times this: logits spread wide, so a greedy token is decided by a clear margin,
    # not a near-tie that bf16 rounding in any kernel flips (two correct servers then agree token for token)
    logit_scale: float = 100.0

    def check(self) -> None:
        """Raise BadInput naming the field that cannot make a model SGLang serves."""
        for name in ("heads_per_rank", "tp", "layers", "hidden_size", "context_length"):
            if getattr(self, name) < 1:
                raise BadInput(f"checkpoint: {name} must be at least 1, got {getattr(self, name)}")
        if self.hidden_size % 64:
            raise BadInput(f"checkpoint: hidden_size must be a multiple of 64, got {self.hidden_size}")
        if not self.logit_scale > 0:
            raise BadInput(f"checkpoint: logit_scale must be > 0, got {self.logit_scale}")
        if not 256 + len(SPECIAL_TOKENS) < self.vocab <= 65536:
            raise BadInput(f"checkpoint: vocab must be in {256 + len(SPECIAL_TOKENS) + 1}..65536, got {self.vocab}")

    @property
    def num_heads(self) -> int:
        return self.heads_per_rank * self.tp


def config_dict(spec: TinySpec, vocab_size: int) -> dict:
    """The config.json fields of the tiny model (transformers' DeepseekV3Config arguments plus SGLang's)."""
    spec.check()
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": 2 * spec.hidden_size,
        "moe_intermediate_size": spec.hidden_size,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_heads,
        "q_lora_rank": spec.hidden_size,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
        "qk_nope_head_dim": QK_NOPE_HEAD_DIM,
        "v_head_dim": V_HEAD_DIM,
        "first_k_dense_replace": spec.layers,  # every layer dense
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "max_position_embeddings": spec.context_length,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "tie_word_embeddings": False,
        **SGLANG_FIELDS,
    }


def train_tokenizer(vocab: int):
    """A byte-level BPE tokenizer trained on `CORPUS` (deterministic), as transformers' fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _matches(directory: Path, spec: TinySpec) -> bool:
    try:
        return json.loads((directory / STAMP).read_text()) == asdict(spec)
    except (OSError, ValueError):
        return False


def build_checkpoint(spec: TinySpec, directory: Path) -> Path:
    """Write the tiny model (bf16 safetensors, config.json, tokenizer) to `directory` and return it. A directory
    built from the same spec is reused; any other existing one is refused (CheckpointError), never overwritten. The
    files appear together: built in a temporary sibling, then renamed."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    spec.check()
    directory = Path(directory)
    if directory.exists():
        if _matches(directory, spec):
            return directory
        raise CheckpointError(f"{directory}: exists and is not a kdtree tiny checkpoint of this spec ({STAMP} differs)")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        tokenizer = train_tokenizer(spec.vocab)
        vocab_size = -(-len(tokenizer) // 64) * 64
        cfg = config_dict(spec, vocab_size)
        torch.manual_seed(spec.seed)
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg))
        with torch.no_grad():
            model.lm_head.weight.mul_(spec.logit_scale)
        model = model.to(torch.bfloat16)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        saved = json.loads((tmp / "config.json").read_text())
        saved.update(SGLANG_FIELDS)  # fields transformers does not keep
        (tmp / "config.json").write_text(json.dumps(saved, indent=1))
        (tmp / STAMP).write_text(json.dumps(asdict(spec), indent=1))
        tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory
