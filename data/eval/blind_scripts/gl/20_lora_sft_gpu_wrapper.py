#!/usr/bin/env python3
"""LoRA SFT job wrapper used by the eval team's fine-tuning queue.

    python 20_lora_sft_gpu_wrapper.py --gpu-ids 2,3,4,5 --base /models/Llama-3.1-8B \
        --data /data/sft/support_v4.jsonl --out /shared/sft/llama8b-support-v4

The wrapper gives every worker its own GPU, its own log file and a heartbeat
file; if any worker exits non-zero or stops heart-beating for --stall-timeout
seconds, the whole group is torn down and the wrapper exits non-zero so that
the queue can retry the job.
"""
import argparse
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--gpu-ids", default="0")
    ap.add_argument("--stall-timeout", type=int, default=1800)
    ap.add_argument("--base", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lora-r", type=int, default=16)
    return ap.parse_args()


# ----------------------------------------------------------------- wrapper
def _port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def wrapper(args):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s wrapper: %(message)s")
    log = logging.getLogger("wrapper")
    gpu_ids = [g for g in args.gpu_ids.split(",") if g]
    world = len(gpu_ids)
    port = _port()
    run_dir = os.path.join(args.out, "run")
    os.makedirs(run_dir, exist_ok=True)

    procs = []
    for i, gpu in enumerate(gpu_ids):
        env = os.environ.copy()
        env.update(CUDA_VISIBLE_DEVICES=gpu, RANK=str(i), LOCAL_RANK=str(i), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HEARTBEAT=os.path.join(run_dir, f"hb{i}"),
                   TOKENIZERS_PARALLELISM="false")
        out = open(os.path.join(run_dir, f"rank{i}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", *sys.argv[1:]],
                                      env=env, stdout=out, stderr=subprocess.STDOUT))
        out.close()
    log.info("started %d workers on GPUs %s", world, gpu_ids)

    def teardown(*_):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()

    signal.signal(signal.SIGTERM, lambda *a: (teardown(), sys.exit(143)))
    signal.signal(signal.SIGINT, lambda *a: (teardown(), sys.exit(130)))

    start = time.time()
    while True:
        rcs = [p.poll() for p in procs]
        if all(rc == 0 for rc in rcs):
            log.info("job finished")
            return 0
        if any(rc not in (None, 0) for rc in rcs):
            log.error("worker exit codes %s", rcs)
            teardown()
            return 1
        for i in range(world):
            hb = os.path.join(run_dir, f"hb{i}")
            last = os.path.getmtime(hb) if os.path.exists(hb) else start
            if time.time() - last > args.stall_timeout:
                log.error("rank %d has not reported for %ds, assuming a hang", i, args.stall_timeout)
                teardown()
                return 2
        time.sleep(15)


# ----------------------------------------------------------------- worker
class SFTData(Dataset):
    def __init__(self, path, tok, max_len):
        self.rows = [json.loads(l) for l in open(path) if l.strip()]
        self.tok, self.max_len = tok, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        msgs = self.rows[i]["messages"]
        prompt = self.tok.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True)
        p = self.tok(prompt, add_special_tokens=False)["input_ids"]
        a = self.tok(msgs[-1]["content"] + self.tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = (p + a)[: self.max_len]
        labels = ([-100] * len(p) + a)[: self.max_len]
        return ids, labels


def pad_collate(batch, pad_id):
    n = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), n), pad_id)
    labels = torch.full((len(batch), n), -100)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for j, (x, y) in enumerate(batch):
        ids[j, : len(x)] = torch.tensor(x)
        labels[j, : len(y)] = torch.tensor(y)
        mask[j, : len(x)] = 1
    return ids, mask, labels


def beat():
    with open(os.environ["HEARTBEAT"], "w") as f:
        f.write(str(time.time()))


def worker(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.cuda.current_device()
    beat()

    tok = AutoTokenizer.from_pretrained(args.base)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    ds = SFTData(args.data, tok, args.max_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=42)
    dl = DataLoader(ds, batch_size=args.micro_batch, sampler=sampler, num_workers=2,
                    collate_fn=functools.partial(pad_collate, pad_id=tok.pad_token_id), drop_last=True)
    accum = max(1, args.global_batch // (args.micro_batch * world))

    model = AutoModelForCausalLM.from_pretrained(args.base, torch_dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").to(device)
    model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.05,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                             "gate_proj", "up_proj", "down_proj"],
                                             task_type="CAUSAL_LM"))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    model = DDP(model, device_ids=[device])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    steps = args.epochs * len(dl) // accum
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * steps), steps)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, (ids, mask, labels) in enumerate(dl):
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            sync = (i + 1) % accum == 0
            with (model.no_sync() if not sync else torch.enable_grad()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss / accum
                loss.backward()
            if not sync:
                continue
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                beat()
                l = loss.detach() * accum
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{steps} loss {l.item():.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e}", flush=True)
        if rank == 0:
            model.module.save_pretrained(os.path.join(args.out, f"adapter_epoch{epoch}"))
        dist.barrier()

    if rank == 0:
        tok.save_pretrained(os.path.join(args.out, f"adapter_epoch{args.epochs - 1}"))
    dist.destroy_process_group()


if __name__ == "__main__":
    a = parse()
    if a.worker:
        worker(a)
    else:
        sys.exit(wrapper(a))
