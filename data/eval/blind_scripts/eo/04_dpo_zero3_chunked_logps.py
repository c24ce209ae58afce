#!/usr/bin/env python
"""DPO for Llama-3-8B with DeepSpeed ZeRO-3.

The full [2B, T, 128k] logits tensor does not fit next to an 8B model, so response
log-probs are computed in chunks of positions straight from the last hidden state.

    deepspeed --num_gpus 8 04_dpo_zero3_chunked_logps.py \
        --model ckpts/llama3-8b-sft --pairs data/prefs_llama3.jsonl --out runs/dpo-llama3-8b
"""
import argparse
import json
import os
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations import HfDeepSpeedConfig

IGNORE = -100


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--pairs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=5e-7)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--micro_bs", type=int, default=1)
    ap.add_argument("--grad_accum", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--max_prompt_len", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=512, help="positions per log-prob chunk")
    ap.add_argument("--save_every", type=int, default=200)
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    return ap.parse_args()


def ds_config(args, world):
    return {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_bs * args.grad_accum * world,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                      "warmup_num_steps": args.warmup}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e8,
            "stage3_prefetch_bucket_size": 5e8,
            "stage3_param_persistence_threshold": 1e6,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 1000000,
        "wall_clock_breakdown": False,
    }


class PairSet(Dataset):
    def __init__(self, path, tok, max_len, max_prompt_len):
        self.rows = []
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                p = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=True,
                                            add_generation_prompt=True)[-max_prompt_len:]
                c = tok(r["chosen"] + "<|eot_id|>", add_special_tokens=False)["input_ids"]
                j = tok(r["rejected"] + "<|eot_id|>", add_special_tokens=False)["input_ids"]
                self.rows.append((p, c[: max_len - len(p)], j[: max_len - len(p)]))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class Collate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        seqs = [(p, c) for p, c, _ in batch] + [(p, j) for p, _, j in batch]
        T = max(len(p) + len(r) for p, r in seqs)
        ids = torch.full((len(seqs), T), self.pad_id, dtype=torch.long)
        lab = torch.full((len(seqs), T), IGNORE, dtype=torch.long)
        att = torch.zeros((len(seqs), T), dtype=torch.long)
        for i, (p, r) in enumerate(seqs):
            n = len(p) + len(r)
            ids[i, :n] = torch.tensor(p + r)
            lab[i, len(p):n] = torch.tensor(r)
            att[i, :n] = 1
        return ids, att, lab


def chunked_response_logps(lm, ids, att, lab, chunk):
    """Sum of log p(response tokens) without materialising all logits at once."""
    hidden = lm.model(input_ids=ids, attention_mask=att).last_hidden_state  # [B, T, H]
    hidden = hidden[:, :-1]
    targets = lab[:, 1:]
    total = hidden.new_zeros(hidden.size(0), dtype=torch.float32)
    weight = lm.lm_head.weight
    for s in range(0, hidden.size(1), chunk):
        h = hidden[:, s: s + chunk]
        t = targets[:, s: s + chunk]
        logits = F.linear(h, weight).float()
        valid = t != IGNORE
        lp = logits.log_softmax(-1).gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        total = total + (lp * valid).sum(-1)
    n = total.size(0) // 2
    return total[:n], total[n:]


def main():
    args = get_args()
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)

    config = ds_config(args, world)
    dschf = HfDeepSpeedConfig(config)  # keep alive: makes from_pretrained load straight into ZeRO-3 shards

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = "<|finetune_right_pad_id|>" if "<|finetune_right_pad_id|>" in tok.get_vocab() else tok.eos_token

    data = PairSet(args.pairs, tok, args.max_len, args.max_prompt_len)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.micro_bs, sampler=sampler, collate_fn=Collate(tok.pad_token_id),
                        num_workers=2, pin_memory=True)

    policy = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.config.use_cache = False
    engine, _, _, _ = deepspeed.initialize(model=policy, model_parameters=policy.parameters(), config=config)

    # frozen reference: plain bf16 replica on every GPU (16 GB), no optimizer state
    del dschf
    ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(device).eval()
    ref.requires_grad_(False)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"pairs={len(data)} micro_steps/epoch={len(loader)} global_batch={config['train_batch_size']}", flush=True)

    micro = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for ids, att, lab in loader:
            ids, att, lab = ids.to(device), att.to(device), lab.to(device)
            pc, pr = chunked_response_logps(engine.module, ids, att, lab, args.chunk)
            with torch.no_grad():
                rc, rr = chunked_response_logps(ref, ids, att, lab, args.chunk)
            z = (pc - pr) - (rc - rr)
            loss = -F.logsigmoid(args.beta * z).mean()
            engine.backward(loss)
            engine.step()
            micro += 1

            if micro % args.grad_accum == 0:  # an optimizer step just happened
                step = engine.global_steps
                stats = torch.stack([loss.detach().float(), (z > 0).float().mean(), args.beta * z.detach().mean()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(json.dumps({"step": step, "loss": stats[0].item(), "acc": stats[1].item(),
                                      "margin": stats[2].item(), "lr": engine.get_lr()[0],
                                      "elapsed": int(time.time() - t0)}), flush=True)
                if step % args.save_every == 0:
                    engine.save_16bit_model(os.path.join(args.out, f"step{step}"))

    engine.save_16bit_model(os.path.join(args.out, "final"))
    if rank == 0:
        tok.save_pretrained(os.path.join(args.out, "final"))
        engine.module.config.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
