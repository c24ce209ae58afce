"""
Rejection-sampling fine-tuning (RFT / expert iteration step): SFT on the
verified-correct samples that the last GRPO round produced (jsonl with
prompt / completion / reward), with DeepSpeed ZeRO-2 and CPU-offloaded Adam.

    deepspeed --num_gpus 8 20_rft_sft_deepspeed.py \
        --model Qwen/Qwen2.5-7B-Instruct --data rollouts/round3_correct.jsonl \
        --out ckpt/rft_round3 --micro_batch 8 --grad_accum 4
"""
import argparse
import json
import math
import os
import random
import time

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-7B-Instruct")
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="ckpt/rft")
    p.add_argument("--micro_batch", type=int, default=8)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max_len", type=int, default=3072)
    p.add_argument("--min_reward", type=float, default=1.0)
    p.add_argument("--max_per_prompt", type=int, default=4, help="dedupe: keep at most this many per prompt")
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


class RFTData(Dataset):
    def __init__(self, path, tok, max_len, min_reward, max_per_prompt, seed=0):
        by_prompt = {}
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if r["reward"] >= min_reward:
                    by_prompt.setdefault(r["prompt"], []).append(r["completion"])
        rng = random.Random(seed)
        self.rows = []
        for prompt, comps in sorted(by_prompt.items()):
            comps = sorted(set(comps))
            rng.shuffle(comps)
            self.rows += [(prompt, c) for c in comps[:max_per_prompt]]
        self.tok, self.max_len = tok, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        prompt, comp = self.rows[i]
        p = self.tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
        p_ids = self.tok(p, add_special_tokens=False).input_ids
        c_ids = self.tok(comp + "<|im_end|>", add_special_tokens=False).input_ids
        ids = (p_ids + c_ids)[: self.max_len]
        labels = ([-100] * len(p_ids) + c_ids)[: self.max_len]
        return ids, labels


def collate(batch, pad_id):
    L = max(len(i) for i, _ in batch)
    ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), L), -100, dtype=torch.long)
    attn = torch.zeros((len(batch), L), dtype=torch.long)
    for k, (i, l) in enumerate(batch):
        ids[k, :len(i)] = torch.tensor(i)
        labels[k, :len(l)] = torch.tensor(l)
        attn[k, :len(i)] = 1
    return ids, labels, attn


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    tok = AutoTokenizer.from_pretrained(args.model)
    ds = RFTData(args.data, tok, args.max_len, args.min_reward, args.max_per_prompt)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=args.micro_batch, sampler=sampler, num_workers=4, pin_memory=True,
                    collate_fn=lambda b: collate(b, tok.pad_token_id))
    updates_per_epoch = math.ceil(len(dl) / args.grad_accum)
    total_updates = updates_per_epoch * args.epochs

    ds_config = {
        "train_batch_size": 512,  # sequences per optimizer step, same as the GRPO rollout batch
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "allgather_bucket_size": 2e8,
            "reduce_bucket_size": 2e8,
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": total_updates, "warmup_num_steps": int(0.05 * total_updates),
                                 "cos_min_ratio": 0.1}},
        "steps_per_print": 100000,
    }

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    if rank == 0:
        print(f"{len(ds)} samples, {total_updates} updates, world {world}", flush=True)

    # resume from the latest DeepSpeed checkpoint if there is one
    start_epoch = 0
    if os.path.exists(os.path.join(args.out, "latest")):
        _, client = engine.load_checkpoint(args.out)
        start_epoch = client["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        t0 = time.time()
        run_loss = torch.zeros(2, device=engine.device)
        for it, (ids, labels, attn) in enumerate(dl):
            ids, labels, attn = ids.to(engine.device), labels.to(engine.device), attn.to(engine.device)
            out = engine(input_ids=ids, attention_mask=attn, labels=labels)
            engine.backward(out.loss)
            engine.step()
            run_loss += torch.stack([out.loss.detach().float(), torch.ones((), device=engine.device)])

            if (it + 1) % args.grad_accum == 0 and engine.global_steps % 20 == 0:
                dist.all_reduce(run_loss)
                if rank == 0:
                    print(f"epoch {epoch} update {engine.global_steps}/{total_updates} "
                          f"loss {(run_loss[0] / run_loss[1]).item():.4f} lr {engine.get_lr()[0]:.2e} "
                          f"{time.time() - t0:.0f}s", flush=True)
                run_loss.zero_()

        engine.save_checkpoint(args.out, tag=f"epoch{epoch}", client_state={"epoch": epoch})

    hf_dir = os.path.join(args.out, "hf")
    engine.save_16bit_model(hf_dir, "model.safetensors")
    if rank == 0:
        engine.module.config.save_pretrained(hf_dir)
        tok.save_pretrained(hf_dir)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
