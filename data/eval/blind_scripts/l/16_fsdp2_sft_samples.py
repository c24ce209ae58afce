"""
Full-parameter SFT of Qwen2.5-7B with FSDP2 (fully_shard per decoder layer), bf16 params,
fp32 reductions. Every --sample_every steps we print a few greedy completions for a
fixed set of probe prompts so we can eyeball regressions in the log.

torchrun --nnodes=1 --nproc_per_node=8 16_fsdp2_sft_samples.py \
    --model Qwen/Qwen2.5-7B --data data/sft_mix.jsonl --out /ckpt/qwen7b_sft
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer

PROBES = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between TCP and UDP in two sentences.",
    "Translate to French: The meeting has been moved to Thursday afternoon.",
]


class ChatJsonl(Dataset):
    def __init__(self, path, tok, max_len):
        self.rows = [json.loads(l) for l in open(path)]
        self.tok, self.max_len = tok, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        msgs = self.rows[i]["messages"]
        prompt = self.tok.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=True)
        answer = self.tok(msgs[-1]["content"] + self.tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = (prompt + answer)[: self.max_len]
        labels = ([-100] * len(prompt) + answer)[: self.max_len]
        return ids, labels


def collate_fn(pad_id):
    def f(batch):
        L = max(len(x) for x, _ in batch)
        ids = torch.full((len(batch), L), pad_id)
        lab = torch.full((len(batch), L), -100)
        att = torch.zeros((len(batch), L), dtype=torch.long)
        for i, (x, y) in enumerate(batch):
            ids[i, : len(x)], lab[i, : len(y)], att[i, : len(x)] = torch.tensor(x), torch.tensor(y), 1
        return ids, lab, att
    return f


@torch.no_grad()
def print_samples(model, tok, device, step):
    model.eval()
    for p in PROBES:
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                       add_generation_prompt=True)
        enc = tok(text, return_tensors="pt").to(device)
        out = model.generate(**enc, max_new_tokens=128, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        print(f"--- step {step} | {p}\n{tok.decode(out[0, enc['input_ids'].shape[1]:], skip_special_tokens=True)}",
              flush=True)
    model.train()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-7B")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_len", type=int, default=4096)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--sample_every", type=int, default=250)
    ap.add_argument("--save_every", type=int, default=1000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    mesh = init_device_mesh("cuda", (world,))

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.pad_token or "<|endoftext|>"

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to(device)

    ds = ChatJsonl(args.data, tok, args.max_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, collate_fn=collate_fn(tok.pad_token_id),
                    num_workers=4, pin_memory=True, drop_last=True)

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    total = len(dl) * args.epochs
    warm = max(1, int(0.03 * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))

    step = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for ids, lab, att in dl:
            ids, lab, att = ids.to(device), lab.to(device), att.to(device)
            loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {l.item():.4f} gnorm {gn.item():.3f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 10:.2f}s/it", flush=True)
                t0 = time.time()

            if step % args.sample_every == 0 and rank == 0:
                print_samples(model, tok, device, step)

            if step % args.save_every == 0:
                msd, osd = get_state_dict(model, optim)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(args.out, f"step_{step}"))

    msd, _ = get_state_dict(model, optim)
    dcp.save({"model": msd}, checkpoint_id=os.path.join(args.out, "final"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
