"""
LLM-based text embedder (e5-mistral recipe): Mistral-7B + LoRA, last-token pooling,
InfoNCE with in-batch + hard negatives. DeepSpeed ZeRO-2, bf16.

deepspeed --hostfile ./hostfile --num_nodes 2 --num_gpus 8 17_mistral_embed_lora_deepspeed.py \
    --train_data data/synthetic_retrieval.jsonl --output_dir ckpt/mistral-embed-lora
"""
import argparse
import json
import os
import random

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer

DS_CONFIG = {
    "train_batch_size": 512,
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-4, "warmup_num_steps": 100, "total_num_steps": None},
    },
    "zero_optimization": {
        "stage": 2,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 2e8,
        "allgather_bucket_size": 2e8,
    },
    "steps_per_print": 50,
}


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mistralai/Mistral-7B-v0.1")
    ap.add_argument("--train_data", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.02)
    ap.add_argument("--q_len", type=int, default=256)
    ap.add_argument("--d_len", type=int, default=512)
    ap.add_argument("--lora_r", type=int, default=16)
    ap.add_argument("--save_every", type=int, default=200)
    ap = deepspeed.add_config_arguments(ap)
    ap.add_argument("--local_rank", type=int, default=-1)
    return ap.parse_args()


class RetrievalTriples(Dataset):
    def __init__(self, path):
        self.rows = [json.loads(l) for l in open(path, encoding="utf-8")]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        q = f"Instruct: {r['task']}\nQuery: {r['query']}"
        return q, r["positive"], random.choice(r["hard_negatives"])


class TripleCollator:
    def __init__(self, tok, q_len, d_len):
        self.tok, self.q_len, self.d_len = tok, q_len, d_len

    def _enc(self, texts, max_len):
        # append eos so last-token pooling sees the end-of-text state
        b = self.tok(texts, max_length=max_len - 1, truncation=True, padding=False)
        b["input_ids"] = [x + [self.tok.eos_token_id] for x in b["input_ids"]]
        b["attention_mask"] = [x + [1] for x in b["attention_mask"]]
        return self.tok.pad(b, padding=True, return_tensors="pt")

    def __call__(self, batch):
        qs, ps, ns = zip(*batch)
        return self._enc(list(qs), self.q_len), self._enc(list(ps) + list(ns), self.d_len)


def last_token_pool(hidden, mask):
    # right padding: take the last non-pad position
    idx = mask.sum(dim=1) - 1
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), idx]


class Embedder(torch.nn.Module):
    def __init__(self, name, r):
        super().__init__()
        base = AutoModel.from_pretrained(name, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.enable_input_require_grads()
        cfg = LoraConfig(r=r, lora_alpha=32, lora_dropout=0.1,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        self.lm = get_peft_model(base, cfg)

    def embed(self, feats):
        h = self.lm(input_ids=feats["input_ids"], attention_mask=feats["attention_mask"]).last_hidden_state
        return F.normalize(last_token_pool(h, feats["attention_mask"]).float(), dim=-1)

    def forward(self, q, d, temperature):
        qe, de = self.embed(q), self.embed(d)
        scores = qe @ de.T / temperature  # (B, 2B): B positives then B hard negatives
        labels = torch.arange(qe.shape[0], device=qe.device)
        return F.cross_entropy(scores, labels)


def main():
    args = get_args()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    random.seed(rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.unk_token
    tok.padding_side = "right"
    model = Embedder(args.model, args.lora_r)

    ds = RetrievalTriples(args.train_data)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True)
    dl = DataLoader(ds, batch_size=DS_CONFIG["train_micro_batch_size_per_gpu"], sampler=sampler,
                    collate_fn=TripleCollator(tok, args.q_len, args.d_len), num_workers=4, drop_last=True)

    accum = DS_CONFIG["gradient_accumulation_steps"]
    DS_CONFIG["scheduler"]["params"]["total_num_steps"] = max(1, len(dl) // accum * args.epochs)
    DS_CONFIG["scheduler"]["params"]["warmup_num_steps"] = min(100, DS_CONFIG["scheduler"]["params"]["total_num_steps"] // 10)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=DS_CONFIG,
    )

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        model.lm.print_trainable_parameters()

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for q, d in dl:
            q = {k: v.to(device) for k, v in q.items()}
            d = {k: v.to(device) for k, v in d.items()}
            loss = engine(q, d, args.temperature)
            engine.backward(loss)
            engine.step()
            step += 1
            if step % (50 * accum) == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} micro-step {step} loss {l.item():.4f} lr {engine.get_lr()[0]:.2e}",
                          flush=True)
            if step % (args.save_every * accum) == 0:
                engine.save_checkpoint(args.output_dir, tag=f"step{step}")
                if rank == 0:
                    engine.module.lm.save_pretrained(os.path.join(args.output_dir, f"lora_step{step}"))
                dist.barrier()

    if rank == 0:
        engine.module.lm.save_pretrained(os.path.join(args.output_dir, "lora_final"))
        tok.save_pretrained(os.path.join(args.output_dir, "lora_final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
