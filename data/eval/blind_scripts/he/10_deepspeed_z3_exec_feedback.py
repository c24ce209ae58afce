"""Self-repair fine-tuning with execution feedback (DeepSpeed ZeRO-3).

Training records come from repository CI logs: a buggy first attempt, the interpreter /
pytest output it produced, and the fixed version. Execution output is wrapped in new
special tokens so the model can tell it apart from code.

    deepspeed --num_gpus 8 10_deepspeed_z3_exec_feedback.py --data data/ci_repair.jsonl
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations import HfDeepSpeedConfig

EXEC_TOKENS = ["<|exec|>", "<|/exec|>", "<|fix|>"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="deepseek-ai/deepseek-coder-6.7b-base")
    p.add_argument("--data", required=True)
    p.add_argument("--problems", default="data/humaneval.jsonl")
    p.add_argument("--save_dir", default="ckpt/z3_exec_feedback")
    p.add_argument("--max_len", type=int, default=4096)
    p.add_argument("--micro_bs", type=int, default=1)
    p.add_argument("--accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


def render(rec):
    return (f"### Task\n{rec['instruction']}\n\n### Attempt\n{rec['attempt']}\n\n"
            f"<|exec|>\n{rec['exec_output'][-2000:]}\n<|/exec|>\n<|fix|>\n")


class RepairDataset(Dataset):
    def __init__(self, path, tok, max_len):
        self.rows = []
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                a = tok(render(rec), add_special_tokens=True)["input_ids"]
                b = tok(rec["fixed"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                if len(a) + len(b) <= max_len:
                    self.rows.append((a, b))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class Collate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        L = max(len(a) + len(b) for a, b in batch)
        ids = torch.full((len(batch), L), self.pad_id, dtype=torch.long)
        lab = torch.full((len(batch), L), -100, dtype=torch.long)
        att = torch.zeros((len(batch), L), dtype=torch.long)
        for i, (a, b) in enumerate(batch):
            n = len(a) + len(b)
            ids[i, :n] = torch.tensor(a + b)
            lab[i, len(a):n] = torch.tensor(b)
            att[i, :n] = 1
        return ids, lab, att


def passes(program, timeout):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "candidate.py")
        with open(path, "w") as f:
            f.write(program)
        try:
            return subprocess.run([sys.executable, path], cwd=d, capture_output=True,
                                  timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
            return False


@torch.no_grad()
def humaneval_greedy(engine, tok, problems, args, rank, world, device):
    engine.eval()
    per_rank = math.ceil(len(problems) / world)
    idx = list(range(rank, len(problems), world))
    idx += [idx[-1]] * (per_rank - len(idx))  # equal number of generate calls on every rank
    results = {}
    for i in idx:
        prob = problems[i]
        enc = tok(prob["prompt"], return_tensors="pt").to(device)
        out = engine.module.generate(**enc, max_new_tokens=384, do_sample=False, synced_gpus=True,
                                     pad_token_id=tok.pad_token_id)
        completion = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        completion = completion.split("\ndef ")[0].split("\nclass ")[0].split("\nif __name__")[0]
        program = prob["prompt"] + completion + "\n\n" + prob["test"] + f"\ncheck({prob['entry_point']})\n"
        results[prob["task_id"]] = passes(program, args.timeout)
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    engine.train()
    merged = {}
    for g in gathered:
        merged.update(g)
    return sum(merged.values()) / len(merged)


def main():
    args = get_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    num_added = tok.add_special_tokens({"additional_special_tokens": EXEC_TOKENS})
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    dataset = RepairDataset(args.data, tok, args.max_len)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=11)
    loader = DataLoader(dataset, batch_size=args.micro_bs, sampler=sampler, collate_fn=Collate(tok.pad_token_id),
                        num_workers=2, drop_last=True)
    total_steps = (len(loader) // args.accum) * args.epochs

    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.accum,
        "train_batch_size": args.micro_bs * args.accum * world,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                 "warmup_num_steps": max(1, total_steps // 30), "total_num_steps": total_steps}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e7,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 50,
        "wall_clock_breakdown": False,
    }
    dschf = HfDeepSpeedConfig(ds_config)  # keep this object alive

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.resize_token_embeddings(len(tok))
    if num_added > 0:
        # start the new tokens at the mean of the existing embeddings instead of random init
        with torch.no_grad():
            emb = model.get_input_embeddings().weight
            emb[-num_added:] = emb[:-num_added].mean(dim=0, keepdim=True)
            head = model.get_output_embeddings().weight
            head[-num_added:] = head[:-num_added].mean(dim=0, keepdim=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    with open(args.problems) as f:
        problems = [json.loads(l) for l in f]

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        tot = torch.zeros(2, device=device)
        for i, (ids, lab, att) in enumerate(loader):
            if i >= (len(loader) // args.accum) * args.accum:
                break
            loss = engine(input_ids=ids.to(device), labels=lab.to(device), attention_mask=att.to(device)).loss
            engine.backward(loss)
            engine.step()
            tot += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if (i + 1) % args.accum == 0 and engine.global_steps % 50 == 0:
                dist.all_reduce(tot)
                if rank == 0:
                    print(f"epoch {epoch} step {engine.global_steps}/{total_steps} "
                          f"loss {(tot[0] / tot[1]).item():.4f}", flush=True)
                tot.zero_()

        model.config.use_cache = True
        score = humaneval_greedy(engine, tok, problems, args, rank, world, device)
        model.config.use_cache = False
        if rank == 0:
            print(f"epoch {epoch}: humaneval pass@1 {score:.4f}", flush=True)
        engine.save_checkpoint(args.save_dir, tag=f"epoch{epoch}", client_state={"pass@1": score})
        engine.save_16bit_model(os.path.join(args.save_dir, f"hf_epoch{epoch}"))
        if rank == 0:
            tok.save_pretrained(os.path.join(args.save_dir, f"hf_epoch{epoch}"))
            model.config.save_pretrained(os.path.join(args.save_dir, f"hf_epoch{epoch}"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
