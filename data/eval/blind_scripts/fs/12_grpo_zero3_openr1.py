#!/usr/bin/env python
"""GRPO + periodic reference reset (ProRL-style) with DeepSpeed ZeRO-3.

Every --ref_reset_every steps the reference policy is hard-reset to the current
policy and the optimizer moments are kept, which lets the KL penalty stay
useful over long runs.

    deepspeed --num_gpus=8 12_grpo_zero3_openr1.py --output_dir ckpt/prorl_z3
"""
import argparse
import json
import os
import re

import deepspeed
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer


def build_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B")
    p.add_argument("--dataset", default="open-r1/OpenR1-Math-220k")
    p.add_argument("--output_dir", default="ckpt/prorl_z3")
    p.add_argument("--prompts_per_gpu", type=int, default=4)
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--max_completion_length", type=int, default=2048)
    p.add_argument("--kl_beta", type=float, default=1e-4)
    p.add_argument("--clip_low", type=float, default=0.2)
    p.add_argument("--clip_high", type=float, default=0.28)
    p.add_argument("--ref_reset_every", type=int, default=200)
    p.add_argument("--max_steps", type=int, default=2000)
    p.add_argument("--save_steps", type=int, default=100)
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-6)
    p.add_argument("--local_rank", type=int, default=-1)
    return p


ANSWER = re.compile(r"\\boxed\{(.+?)\}")


def reward_fn(text, gold):
    # strict: the reasoning must be closed and the last boxed answer must match
    if "</think>" not in text:
        return 0.0
    found = ANSWER.findall(text.split("</think>")[-1])
    if not found:
        return 0.0
    return 1.0 if found[-1].replace(" ", "") == gold.replace(" ", "") else 0.0


def token_logps(model, ids, attn, P, chunk):
    out = []
    for i in range(0, ids.size(0), chunk):
        logits = model(input_ids=ids[i:i + chunk], attention_mask=attn[i:i + chunk]).logits[:, P - 1:-1]
        out.append(torch.log_softmax(logits.float(), -1).gather(-1, ids[i:i + chunk, P:, None]).squeeze(-1))
    return torch.cat(out)


@torch.no_grad()
def reset_reference(ref_model, engine):
    ref_model.load_state_dict(engine.module.state_dict())
    ref_model.eval()


def main():
    args = build_parser().parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(rank + 11)

    n_seq = args.prompts_per_gpu * args.num_generations
    micro = args.micro_batch
    ds_cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": n_seq // micro,
        "train_batch_size": n_seq * world,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999],
                                                  "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "reduce_bucket_size": 5e8,
            "stage3_max_live_parameters": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "wall_clock_breakdown": False,
    }

    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, _, _, _ = deepspeed.initialize(model=policy, model_parameters=policy.parameters(), config=ds_cfg)

    # the reference is small enough to keep a full copy on every GPU
    ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(device)
    ref.eval().requires_grad_(False)

    ds = load_dataset(args.dataset, "default", split="train").select_columns(["problem", "answer"])
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=args.prompts_per_gpu, sampler=sampler, drop_last=True, collate_fn=lambda r: r)

    step, epoch = 0, 0
    it = iter(dl)
    while step < args.max_steps:
        try:
            rows = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(dl)
            rows = next(it)

        msgs = [[{"role": "user", "content": r["problem"] + "\nPut the final answer in \\boxed{}."}] for r in rows]
        enc = tok.apply_chat_template(msgs, add_generation_prompt=True, padding=True, return_tensors="pt",
                                      return_dict=True).to(device)
        ids = enc["input_ids"].repeat_interleave(args.num_generations, 0)
        am = enc["attention_mask"].repeat_interleave(args.num_generations, 0)
        P = ids.size(1)

        engine.eval()
        with torch.no_grad():
            seq = engine.module.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=0.6,
                                         top_p=0.95, max_new_tokens=args.max_completion_length,
                                         pad_token_id=tok.pad_token_id, synced_gpus=True)
            comp = seq[:, P:]
            e = (comp == tok.eos_token_id).int()
            mask = ((e.cumsum(1) - e) == 0).long()
            attn = torch.cat([am, mask], 1)
            old_lp = token_logps(engine, seq, attn, P, micro)
            ref_lp = token_logps(ref, seq, attn, P, micro)
        engine.train()

        texts = tok.batch_decode(comp, skip_special_tokens=True)
        golds = [r["answer"] for r in rows for _ in range(args.num_generations)]
        rewards = torch.tensor([reward_fn(t, g) for t, g in zip(texts, golds)], device=device)
        g = rewards.view(-1, args.num_generations)
        adv = ((g - g.mean(-1, keepdim=True)) / (g.std(-1, keepdim=True) + 1e-6)).reshape(-1, 1)

        for i in range(0, n_seq, micro):
            sl = slice(i, i + micro)
            logits = engine(input_ids=seq[sl], attention_mask=attn[sl]).logits[:, P - 1:-1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, seq[sl, P:, None]).squeeze(-1)
            ratio = (lp - old_lp[sl]).exp()
            pg = -torch.min(ratio * adv[sl], ratio.clamp(1 - args.clip_low, 1 + args.clip_high) * adv[sl])
            d = ref_lp[sl] - lp
            kl = d.exp() - d - 1
            m = mask[sl].float()
            loss = ((pg + args.kl_beta * kl) * m).sum() / mask.sum().clamp(min=1) * (n_seq // micro)
            engine.backward(loss)
            engine.step()
        step += 1

        if step % args.ref_reset_every == 0:
            reset_reference(ref, engine)
            if rank == 0:
                print(f"[step {step}] reference policy reset", flush=True)

        stats = torch.stack([rewards.mean(), mask.sum(1).float().mean(),
                             (mask.sum(1) == mask.size(1)).float().mean()])
        dist.all_reduce(stats)
        stats /= world
        if rank == 0 and step % 5 == 0:
            print(json.dumps({"step": step, "reward": stats[0].item(), "len": stats[1].item(),
                              "truncated": stats[2].item(), "lr": engine.get_lr()[0]}), flush=True)

        if step % args.save_steps == 0:
            engine.save_checkpoint(args.output_dir, tag=f"global_step{step}", client_state={"step": step})

    engine.save_16bit_model(os.path.join(args.output_dir, "final"))
    if rank == 0:
        tok.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
