"""Real models for tests and benchmarks, built from local configs (nothing is downloaded).

    model, args, kwargs, loss_fn = build("llama")                 # small: trains in tests
    model, args, kwargs, loss_fn = build("llama", full=True)      # Llama-2 7B, on the meta device

Hugging Face transformers (GPT-2, Llama, BERT, T5, Mixtral, ViT; Qwen2-MoE and DeepSeek-V3 kept out of
the per-model suites) are called with labels so
that they return their own loss; the hand-written models (a nanoGPT, a ResNet-style CNN with
BatchNorm, an MLP-Mixer, a model with tied weights, one with a parameter used twice) return
theirs too. `loss_fn(output)` picks the loss out of what the model returns.
"""
from __future__ import annotations

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HF_MODELS = ("gpt2", "llama", "bert", "t5", "mixtral", "vit")
HAND_MODELS = ("nanogpt", "resnet", "mixer", "tied", "shared_param")
MODELS = HF_MODELS + HAND_MODELS
# small configs built like HF_MODELS but kept out of the per-model suites (tests/test_expert_parallel.py)
EXTRA_HF_MODELS = ("qwen2_moe", "deepseek_v3")
# full-size configs planned on the meta device (the sizes)
FULL = {"gpt2": "GPT-2 XL 1.5B", "llama": "Llama-2 7B", "mixtral": "Mixtral 8x7B", "t5": "T5 3B",
        "bert": "BERT-large 340M", "vit": "ViT-Large/16 304M"}


# -- hand-written models ------------------------------------------------------------------------

class NanoGPTAttention(nn.Module):
    """nanoGPT's attention without flash: a causal-mask buffer sliced to the sequence length."""

    def __init__(self, hidden: int, heads: int, block: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class NanoGPTBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, block: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = NanoGPTAttention(hidden, heads, block)
        self.ln_2 = nn.LayerNorm(hidden)
        self.c_fc = nn.Linear(hidden, 4 * hidden)
        self.c_proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    def __init__(self, vocab=64, block=16, hidden=32, heads=4, layers=2):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(block, hidden)
        self.h = nn.ModuleList(NanoGPTBlock(hidden, heads, block) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.wte.weight = self.lm_head.weight                 # weight tying, as nanoGPT does

    def forward(self, idx, targets):
        B, T = idx.shape
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """A small ResNet: stem, two stages of basic blocks, global average pool, classifier."""

    def __init__(self, classes=10, width=8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.MaxPool2d(2))
        self.layer1 = BasicBlock(width, width, 1)
        self.layer2 = BasicBlock(width, 2 * width, 2)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x, labels):
        x = self.layer2(self.layer1(self.stem(x)))
        logits = self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))
        return F.cross_entropy(logits, labels)


class MixerLayer(nn.Module):
    def __init__(self, tokens: int, hidden: int, token_mlp: int, channel_mlp: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.token_mlp = nn.Sequential(nn.Linear(tokens, token_mlp), nn.GELU(), nn.Linear(token_mlp, tokens))
        self.norm2 = nn.LayerNorm(hidden)
        self.channel_mlp = nn.Sequential(nn.Linear(hidden, channel_mlp), nn.GELU(), nn.Linear(channel_mlp, hidden))

    def forward(self, x):                      # x [B, tokens, hidden]
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class MLPMixer(nn.Module):
    def __init__(self, image=16, patch=4, hidden=32, token_mlp=32, channel_mlp=64, layers=2, classes=10):
        super().__init__()
        self.stem = nn.Conv2d(3, hidden, patch, patch)
        tokens = (image // patch) ** 2
        self.layers = nn.ModuleList(MixerLayer(tokens, hidden, token_mlp, channel_mlp) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x, labels):
        x = self.stem(x).flatten(2).transpose(1, 2)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x).mean(dim=1))
        return F.cross_entropy(logits, labels)


class TiedAutoencoder(nn.Module):
    """Two Linear modules holding one weight (tied): encoder and decoder share it."""

    def __init__(self, d=16, hidden=32):
        super().__init__()
        self.inp = nn.Linear(d, hidden)
        self.enc = nn.Linear(hidden, hidden)
        self.dec = nn.Linear(hidden, hidden)
        self.dec.weight = self.enc.weight
        self.out = nn.Linear(hidden, d)

    def forward(self, x):
        h = F.gelu(self.enc(F.gelu(self.inp(x))))
        y = self.out(F.gelu(self.dec(h)))
        return F.mse_loss(y, x)


class SharedParam(nn.Module):
    """One Parameter used twice in a forward (as a recurrent cell would)."""

    def __init__(self, d=16, hidden=32):
        super().__init__()
        self.inp = nn.Linear(d, hidden)
        self.w = nn.Parameter(torch.randn(hidden, hidden) / hidden ** 0.5)
        self.out = nn.Linear(hidden, 4)

    def forward(self, x, labels):
        h = torch.tanh(self.inp(x) @ self.w)
        h = torch.tanh(h @ self.w)
        return F.cross_entropy(self.out(h), labels)


# -- Hugging Face configs -----------------------------------------------------------------------

def hf_config(name: str, full: bool = False):
    import transformers as T
    if name == "gpt2":
        if full:    # GPT-2 XL
            return T.GPT2Config(n_embd=1600, n_layer=48, n_head=25, n_positions=1024, vocab_size=50257)
        return T.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    if name == "llama":
        if full:    # Llama-2 7B
            return T.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                 max_position_embeddings=4096)
        return T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                             bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "bert":
        if full:    # BERT-large
            return T.BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                intermediate_size=4096, vocab_size=30522)
        return T.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, pad_token_id=0)
    if name == "t5":
        if full:    # T5 3B
            return T.T5Config(d_model=1024, d_kv=128, d_ff=16384, num_layers=24, num_heads=32, vocab_size=32128,
                              decoder_start_token_id=0, pad_token_id=0)
        return T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                          num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                          dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    if name == "mixtral":
        if full:    # Mixtral 8x7B
            return T.MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                                   num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=32768)
        return T.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=0,
                               pad_token_id=0)
    if name == "qwen2_moe":     # shared expert with its gate, router logits -> auxiliary balancing loss
        return T.Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                                shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=16, output_router_logits=True, router_aux_loss_coef=0.01,
                                bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "deepseek_v3":
        # one layer: multi-head latent attention (low-rank q and kv, a rotary key shared by the heads, the keys
        # filled slice by slice in place), sigmoid-routed experts (grouped top-k, a correction bias) beside a
        # shared expert
        return T.DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                  num_hidden_layers=1, first_k_dense_replace=0, num_attention_heads=4,
                                  num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, n_group=2,
                                  topk_group=1, num_experts_per_tok=2, q_lora_rank=24, kv_lora_rank=16,
                                  qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=16,
                                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "vit":
        if full:    # ViT-Large/16
            return T.ViTConfig(image_size=224, patch_size=16, hidden_size=1024, num_hidden_layers=24,
                               num_attention_heads=16, intermediate_size=4096, num_labels=1000)
        return T.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0)
    raise ValueError(f"unknown model {name!r}: one of {MODELS}")


_HF_CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertForMaskedLM",
               "t5": "T5ForConditionalGeneration", "mixtral": "MixtralForCausalLM",
               "vit": "ViTForImageClassification", "qwen2_moe": "Qwen2MoeForCausalLM",
               "deepseek_v3": "DeepseekV3ForCausalLM"}


def with_layers(config, layers: int):
    """The same config with fewer layers (full width): plans quickly, same ops and shapes per layer."""
    for attr in ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers"):
        if hasattr(config, attr) and getattr(config, attr) is not None:
            setattr(config, attr, layers)
    return config


def _tokens(g, batch, seq, vocab, low=0):
    return torch.randint(low, vocab, (batch, seq), generator=g)


def build(name: str, *, full: bool = False, layers: int | None = None, batch: int | None = None,
          seq: int | None = None, seed: int = 0):
    """(model, args, kwargs, loss_fn). full=True: the full-size config on the meta device, with meta
    inputs (batch and seq default to 64 and 1024/2048/512); `layers` overrides the depth."""
    g = torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed)
    if name in HF_MODELS + EXTRA_HF_MODELS:
        import transformers as T
        config = hf_config(name, full)
        if layers is not None:
            config = with_layers(config, layers)
        cls = getattr(T, _HF_CLASSES[name])
        if full:
            with torch.device("meta"):
                model = cls(config)
        else:
            model = cls(config)
        model.train()
        batch = batch or (64 if full else 4)
        seq = seq or ({"gpt2": 1024, "llama": 2048, "mixtral": 2048, "t5": 512, "bert": 512}.get(name, 0)
                      if full else 8)
        if name == "vit":
            size = config.image_size
            kwargs = {"pixel_values": torch.randn(batch, 3, size, size, generator=g),
                      "labels": torch.randint(0, config.num_labels, (batch,), generator=g)}
        else:
            vocab = config.vocab_size
            kwargs = {"input_ids": _tokens(g, batch, seq, vocab, low=1), "labels": _tokens(g, batch, seq, vocab, 1)}
            if name == "bert":    # masked LM: only the masked positions count, -100 elsewhere
                masked = torch.rand(batch, seq, generator=g) < 0.5
                kwargs["labels"] = torch.where(masked, kwargs["labels"], torch.full_like(kwargs["labels"], -100))
        if full:
            kwargs = {k: v.to("meta") for k, v in kwargs.items()}
        return model, (), kwargs, lambda out: out.loss
    if full or layers is not None:
        raise ValueError(f"{name} is small only")
    if name == "nanogpt":
        model = NanoGPT()
        return model, (_tokens(g, 4, 8, 64), _tokens(g, 4, 8, 64)), {}, lambda out: out[1]
    if name == "resnet":
        model = ResNet()
        return model, (torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)), {}, \
            lambda out: out
    if name == "mixer":
        model = MLPMixer()
        return model, (torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)), {}, \
            lambda out: out
    if name == "tied":
        return TiedAutoencoder(), (torch.randn(8, 16, generator=g),), {}, lambda out: out
    if name == "shared_param":
        return SharedParam(), (torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)), {}, \
            lambda out: out
    raise ValueError(f"unknown model {name!r}: one of {MODELS}")
