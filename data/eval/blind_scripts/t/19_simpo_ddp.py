"""
SimPO (reference-free, length-normalised preference optimisation) with DDP.
No reference model is needed, so the whole GPU goes to the policy.

    torchrun --standalone --nproc_per_node=8 19_simpo_ddp.py \
        --model meta-llama/Llama-3.2-3B-Instruct \
        --dataset princeton-nlp/llama3-ultrafeedback-armorm --out ckpt/simpo_l3b
"""
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="meta-llama/Llama-3.2-3B-Instruct")
    p.add_argument("--dataset", default="princeton-nlp/llama3-ultrafeedback-armorm")
    p.add_argument("--out", default="ckpt/simpo")
    p.add_argument("--beta", type=float, default=10.0)
    p.add_argument("--gamma_beta_ratio", type=float, default=0.3)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--grad_accum", type=int, default=8)
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--seed", type=int, default=-1, help="-1: draw one on rank 0 and share it")
    return p.parse_args()


def setup(args):
    dist.init_process_group(backend="nccl")
    # one seed for the whole job, so DistributedSampler shuffles identically on every rank
    seed = args.seed if args.seed >= 0 else random.randint(0, 2**31 - 1)
    seed_t = torch.tensor([seed], dtype=torch.long, device="cuda")
    dist.broadcast(seed_t, src=0)
    args.seed = int(seed_t.item())

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    return dist.get_rank(), dist.get_world_size(), local_rank


def encode_pair(tok, ex, max_len):
    prompt = tok.apply_chat_template(ex["chosen"][:-1], tokenize=False, add_generation_prompt=True)
    p_ids = tok(prompt, add_special_tokens=False).input_ids
    out = {}
    for side in ("chosen", "rejected"):
        r_ids = tok(ex[side][-1]["content"] + "<|eot_id|>", add_special_tokens=False).input_ids
        ids = (p_ids + r_ids)[:max_len]
        out[side + "_ids"] = ids
        out[side + "_plen"] = min(len(p_ids), len(ids))
    return out


def collate(rows, pad_id):
    seqs = [r["chosen_ids"] for r in rows] + [r["rejected_ids"] for r in rows]
    plens = [r["chosen_plen"] for r in rows] + [r["rejected_plen"] for r in rows]
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    lmask = torch.zeros(len(seqs), L)
    for i, (s, pl) in enumerate(zip(seqs, plens)):
        ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
        lmask[i, pl:len(s)] = 1.0
    return ids, attn, lmask


def avg_logp(model, ids, attn, lmask):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    lp = torch.gather(logits.log_softmax(-1), 2, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    m = lmask[:, 1:]
    return (lp * m).sum(-1) / m.sum(-1).clamp(min=1)


def main():
    args = parse_args()
    rank, world, local_rank = setup(args)
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = "<|finetune_right_pad_id|>"
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = DDP(model, device_ids=[local_rank])

    raw = load_dataset(args.dataset)
    train = raw["train"].map(lambda ex: encode_pair(tok, ex, args.max_len), remove_columns=raw["train"].column_names)
    test = raw["test"].map(lambda ex: encode_pair(tok, ex, args.max_len), remove_columns=raw["test"].column_names)
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    dl = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=2,
                    collate_fn=lambda b: collate(b, tok.pad_token_id))
    test_dl = DataLoader(test, batch_size=args.batch_size, num_workers=2,
                         sampler=DistributedSampler(test, shuffle=False, drop_last=True),
                         collate_fn=lambda b: collate(b, tok.pad_token_id))

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    updates = math.ceil(len(dl) / args.grad_accum) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(0.1 * updates), updates)
    gamma = args.gamma_beta_ratio * args.beta

    def simpo(batch, net):
        ids, attn, lmask = (t.to(device, non_blocking=True) for t in batch)
        n = ids.shape[0] // 2
        lp = avg_logp(net, ids, attn, lmask)
        z = args.beta * (lp[:n] - lp[n:]) - gamma
        return -F.logsigmoid(z).mean(), (z > -gamma).float().mean()

    upd = 0
    model.train()
    t0 = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, batch in enumerate(dl):
            last_micro = (i + 1) % args.grad_accum == 0 or i + 1 == len(dl)
            model.require_backward_grad_sync = last_micro
            loss, acc = simpo(batch, model)
            (loss / args.grad_accum).backward()
            if not last_micro:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            upd += 1
            if upd % 10 == 0:
                s = torch.stack([loss.detach(), acc])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} upd {upd}/{updates} loss {s[0]:.4f} acc {s[1]:.3f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        model.eval()
        tot = torch.zeros(3, device=device)
        with torch.no_grad():
            for batch in test_dl:
                l, a = simpo(batch, model.module)
                tot += torch.stack([l, a, torch.ones((), device=device)])
        dist.all_reduce(tot)
        model.train()
        if rank == 0:
            print(f"epoch {epoch} test loss {tot[0] / tot[2]:.4f} pref acc {tot[1] / tot[2]:.3f}", flush=True)
            model.module.save_pretrained(os.path.join(args.out, f"epoch{epoch}"), safe_serialization=True)
            tok.save_pretrained(os.path.join(args.out, f"epoch{epoch}"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
