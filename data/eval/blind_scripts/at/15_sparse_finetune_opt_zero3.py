"""
Gradual magnitude pruning + sparse fine-tuning of OPT-1.3B on C4 with DeepSpeed
ZeRO-3. Linear layers inside the decoder blocks are pruned to the target
unstructured sparsity with a cubic schedule; masks are re-applied after every
optimizer step. Perplexity on WikiText-2 is reported at each pruning step.

    deepspeed --num_gpus 8 sparse_ft_opt.py --model facebook/opt-1.3b \
        --c4-shards /shared/c4/en.noblocklist --target-sparsity 0.5
"""
import argparse
import glob
import json
import math
import os

import deepspeed
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="facebook/opt-1.3b")
    p.add_argument("--c4-shards", required=True)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-bs", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--target-sparsity", type=float, default=0.5)
    p.add_argument("--prune-every", type=int, default=250)
    p.add_argument("--prune-until", type=int, default=3000)
    p.add_argument("--out", default="/shared/sparse/opt1.3b_s50")
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


def ds_config(args, world):
    return {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_bs * args.grad_accum * world,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                 "warmup_num_steps": 100, "total_num_steps": args.steps}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 50,
    }


class PackedC4(torch.utils.data.Dataset):
    def __init__(self, files, tok, seq_len, max_docs=400_000):
        ds = load_dataset("json", data_files=files, split="train")
        ds = ds.select(range(min(max_docs, len(ds))))
        ids = []
        for text in ds["text"]:
            ids.extend(tok(text)["input_ids"] + [tok.eos_token_id])
        n = len(ids) // seq_len
        self.data = torch.tensor(ids[: n * seq_len]).view(n, seq_len)

    def __len__(self):
        return self.data.size(0)

    def __getitem__(self, i):
        return self.data[i]


def sparsity_schedule(step, until, final):
    if step >= until:
        return final
    return final * (1 - (1 - step / until) ** 3)


def prunable(module):
    return [(n, p) for n, p in module.named_parameters()
            if n.endswith(".weight") and any(k in n for k in ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"))]


@torch.no_grad()
def compute_masks(module, sparsity):
    masks = {}
    for n, p in prunable(module):
        w = p.data.abs().float()
        k = max(1, int(sparsity * w.numel()))
        thresh = w.flatten().kthvalue(k).values
        masks[n] = (w > thresh).to(p.dtype)
    return masks


@torch.no_grad()
def apply_masks(module, masks):
    for n, p in prunable(module):
        if n in masks:
            p.data.mul_(masks[n])


@torch.no_grad()
def wikitext_ppl(engine, enc, seq_len, device):
    n = enc.size(1) // seq_len
    chunks = list(range(dist.get_rank(), n, dist.get_world_size()))
    nll = torch.zeros(2, device=device)
    engine.eval()
    for i in range(max(len(range(r, n, dist.get_world_size())) for r in range(dist.get_world_size()))):
        j = chunks[i] if i < len(chunks) else chunks[-1]
        x = enc[:, j * seq_len:(j + 1) * seq_len].to(device)
        loss = engine(input_ids=x, labels=x).loss
        if i < len(chunks):
            nll[0] += loss.float() * seq_len
            nll[1] += seq_len
    dist.all_reduce(nll)
    engine.train()
    return math.exp((nll[0] / nll[1]).item())


def main():
    args = parse()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    files = sorted(glob.glob(os.path.join(args.c4_shards, "c4-train.0000[0-3]-of-01024.json.gz")))
    # rank 0 fills the datasets cache first, the others then read it
    if rank != 0:
        dist.barrier()
    train_ds = PackedC4(files, tok, args.seq_len)
    wt2 = load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
    if rank == 0:
        dist.barrier()
    wt2_ids = tok("\n\n".join(wt2["text"]), return_tensors="pt").input_ids
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    loader = DataLoader(train_ds, batch_size=args.micro_bs, sampler=sampler, num_workers=2, drop_last=True)

    config = ds_config(args, world)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    masks = {}
    micro, step, epoch = 0, 0, 0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    log = []
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            x = batch.to(device)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            micro += 1
            if micro % args.grad_accum != 0:
                continue
            step += 1
            if step <= args.prune_until and step % args.prune_every == 0:
                s = sparsity_schedule(step, args.prune_until, args.target_sparsity)
                masks = compute_masks(engine.module, s)
                apply_masks(engine.module, masks)
                ppl = wikitext_ppl(engine, wt2_ids, args.seq_len, device)
                if rank == 0:
                    print(f"step {step}: sparsity -> {s:.3f}, wikitext2 ppl {ppl:.2f}", flush=True)
                    log.append({"step": step, "sparsity": s, "ppl": ppl})
            elif masks:
                apply_masks(engine.module, masks)
            if step >= args.steps:
                break
        epoch += 1

    engine.save_16bit_model(args.out, "pytorch_model.bin")
    if rank == 0:
        tok.save_pretrained(args.out)
        with open(os.path.join(args.out, "prune_log.json"), "w") as f:
            json.dump(log, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
