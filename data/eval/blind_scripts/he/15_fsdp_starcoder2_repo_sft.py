"""FSDP full fine-tuning of StarCoder2-3B on repository instruction data, with
execution-based HumanEval evaluation.

Greedy decoding goes through the FSDP root module (so every layer is gathered as usual);
all ranks decode the same number of batches and stop together.

    torchrun --nproc_per_node=8 15_fsdp_starcoder2_repo_sft.py --train data/repo_sft.jsonl
"""
import argparse
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from transformers.models.starcoder2.modeling_starcoder2 import Starcoder2DecoderLayer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bigcode/starcoder2-3b")
    ap.add_argument("--train", required=True)
    ap.add_argument("--humaneval", default="data/HumanEval.jsonl")
    ap.add_argument("--out", default="runs/fsdp-sc2-3b")
    ap.add_argument("--seq_len", type=int, default=4096)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--eval_every", type=int, default=500)
    ap.add_argument("--gen_len", type=int, default=384)
    return ap.parse_args()


class RepoSFT(Dataset):
    def __init__(self, path, tok, seq_len):
        self.rows = []
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                a = tok(f"<repo_name>{r['repo']}\n### Instruction\n{r['instruction']}\n### Response\n")["input_ids"]
                b = tok(r["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                ids = (a + b)[:seq_len]
                self.rows.append((ids, min(len(a), len(ids))))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class Collate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, rows):
        L = max(len(r[0]) for r in rows)
        ids = torch.full((len(rows), L), self.pad_id, dtype=torch.long)
        lab = torch.full((len(rows), L), -100, dtype=torch.long)
        att = torch.zeros((len(rows), L), dtype=torch.long)
        for i, (x, n_prompt) in enumerate(rows):
            ids[i, :len(x)] = torch.tensor(x)
            lab[i, n_prompt:len(x)] = torch.tensor(x[n_prompt:])
            att[i, :len(x)] = 1
        return ids, lab, att


@torch.no_grad()
def greedy_decode(model, input_ids, attention_mask, max_new_tokens, eos_id):
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cur, past, out_tokens = input_ids, None, []
    finished = torch.zeros(input_ids.size(0), dtype=torch.bool, device=input_ids.device)
    for _ in range(max_new_tokens):
        out = model(input_ids=cur, attention_mask=attention_mask, position_ids=pos,
                    past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1)
        nxt = torch.where(finished, torch.full_like(nxt, eos_id), nxt)
        out_tokens.append(nxt)
        finished |= nxt == eos_id
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.size(0), 1)], 1)
        pos = pos[:, -1:] + 1
        cur = nxt[:, None]
        all_done = finished.all().to(torch.int32)
        dist.all_reduce(all_done, op=dist.ReduceOp.MIN)
        if all_done.item():
            break
    return torch.stack(out_tokens, 1)


def run_check(program, timeout=10.0):
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "prog.py")
        with open(p, "w") as f:
            f.write(program)
        try:
            return subprocess.run([sys.executable, p], cwd=d, capture_output=True, timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
            return False


def humaneval_pass1(model, tok, problems, args, rank, world, device, chunk=12):
    model.eval()
    per_rank = math.ceil(len(problems) / world)
    mine = problems[rank * per_rank:(rank + 1) * per_rank]
    n_chunks = math.ceil(per_rank / chunk)
    results = {}
    tok.padding_side = "left"
    for c in range(n_chunks):
        batch = mine[c * chunk:(c + 1) * chunk] or problems[:1]  # keep the collective pattern identical
        enc = tok([p["prompt"] for p in batch], return_tensors="pt", padding=True).to(device)
        gen = greedy_decode(model, enc["input_ids"], enc["attention_mask"], args.gen_len, tok.eos_token_id)
        texts = tok.batch_decode(gen, skip_special_tokens=True)
        if not mine[c * chunk:(c + 1) * chunk]:
            continue
        for p, t in zip(batch, texts):
            for stop in ("\ndef ", "\nclass ", "\nif __name__", "\nprint("):
                t = t.split(stop)[0]
            results[p["task_id"]] = run_check(p["prompt"] + t + "\n\n" + p["test"] + f"\ncheck({p['entry_point']})\n")
    tok.padding_side = "right"
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    model.train()
    merged = {k: v for g in gathered for k, v in g.items()}
    return sum(merged.values()) / len(merged)


def save_full_checkpoint(model, tok, path, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        model.module.save_pretrained(path, state_dict=state, safe_serialization=True)
        tok.save_pretrained(path)
    dist.barrier()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32, low_cpu_mem_usage=True)
    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Starcoder2DecoderLayer})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=wrap_policy, mixed_precision=mp,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.cuda.current_device(),
                 limit_all_gathers=True, use_orig_params=True)
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Starcoder2DecoderLayer),
    )

    ds = RepoSFT(args.train, tok, args.seq_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, collate_fn=Collate(tok.pad_token_id),
                        num_workers=4, pin_memory=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total = len(loader) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * total), total)

    with open(args.humaneval) as f:
        problems = [json.loads(l) for l in f]

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for ids, lab, att in loader:
            loss = model(input_ids=ids.to(device), labels=lab.to(device), attention_mask=att.to(device)).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {l.item():.4f} "
                          f"{(time.time() - t0) / 20:.2f}s/it", flush=True)
                t0 = time.time()
            if step % args.eval_every == 0:
                score = humaneval_pass1(model, tok, problems, args, rank, world, device)
                if rank == 0:
                    print(f"step {step}: humaneval pass@1 {score:.4f}", flush=True)

        save_full_checkpoint(model, tok, os.path.join(args.out, f"epoch{epoch}"), rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
