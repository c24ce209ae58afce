"""GRPO with FSDP2 (fully_shard) on DeepScaleR problems.

Policy and reference are both sharded over all ranks. Generation goes through the
sharded model (every decode step all-gathers the layers), so every rank must run
the same number of forward passes -> synced_gpus=True.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        09_grpo_fsdp2_deepscaler.py --model Qwen/Qwen2.5-Math-1.5B --ckpt_dir /lustre/ckpt/grpo_fsdp2
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from datasets import load_dataset
from math_verify import parse, verify
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer

SUFFIX = " Let's think step by step and output the final answer within \\boxed{}."


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-Math-1.5B")
    p.add_argument("--ckpt_dir", required=True)
    p.add_argument("--prompts_per_rank", type=int, default=2)
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--max_new_tokens", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--beta", type=float, default=0.001)
    p.add_argument("--clip_lo", type=float, default=0.2)
    p.add_argument("--clip_hi", type=float, default=0.28)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--save_every", type=int, default=100)
    return p.parse_args()


def shard(model, mp):
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def logps(model, ids, attn, P):
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, P - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, P:, None]).squeeze(-1)


def reward(text, answer):
    try:
        return float(verify(parse(f"\\boxed{{{answer}}}"), parse(text)))
    except Exception:
        return 0.0


def main():
    a = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(rank)

    tok = AutoTokenizer.from_pretrained(a.model, padding_side="left")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    policy = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = shard(policy, mp)
    policy.to(dev)
    ref = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.bfloat16)
    ref.requires_grad_(False)
    ref = shard(ref, MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    ref.to(dev).eval()

    opt = torch.optim.AdamW(policy.parameters(), lr=a.lr, weight_decay=0.0, betas=(0.9, 0.99))

    step = 0
    latest = os.path.join(a.ckpt_dir, "latest")
    if os.path.exists(os.path.join(latest, ".metadata")):
        # DCP checkpoints are sharded per rank and can be re-sharded on load
        msd, osd = get_state_dict(policy, opt)
        state = {"model": msd, "optim": osd, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=latest)
        set_state_dict(policy, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = int(state["step"])
        if rank == 0:
            print(f"resumed from step {step}")

    ds = load_dataset("agentica-org/DeepScaleR-Preview-Dataset", split="train")
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=42, drop_last=True)
    dl = DataLoader(ds, batch_size=a.prompts_per_rank, sampler=sampler, collate_fn=lambda x: x, drop_last=True)
    epoch = step // len(dl)

    while step < a.steps:
        sampler.set_epoch(epoch)
        for rows in dl:
            t0 = time.time()
            prompts = [tok.apply_chat_template([{"role": "user", "content": r["problem"] + SUFFIX}],
                                               tokenize=False, add_generation_prompt=True) for r in rows]
            enc = tok(prompts, return_tensors="pt", padding=True).to(dev)
            ids = enc.input_ids.repeat_interleave(a.G, 0)
            am = enc.attention_mask.repeat_interleave(a.G, 0)
            P = ids.size(1)

            policy.eval()
            with torch.no_grad():
                seq = policy.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=1.0,
                                      max_new_tokens=a.max_new_tokens, pad_token_id=tok.pad_token_id,
                                      synced_gpus=True)
                resp = seq[:, P:]
                e = (resp == tok.eos_token_id).int()
                mask = ((e.cumsum(1) - e) == 0).long()
                attn = torch.cat([am, mask], 1)
                old, refl = [], []
                for i in range(0, seq.size(0), a.micro):
                    old.append(logps(policy, seq[i:i + a.micro], attn[i:i + a.micro], P))
                    refl.append(logps(ref, seq[i:i + a.micro], attn[i:i + a.micro], P))
                old, refl = torch.cat(old), torch.cat(refl)
            policy.train()

            texts = tok.batch_decode(resp, skip_special_tokens=True)
            r = torch.tensor([reward(t, row["answer"]) for t, row in
                              zip(texts, [row for row in rows for _ in range(a.G)])], device=dev)
            g = r.view(-1, a.G)
            adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(-1, 1)

            # token-level normalisation over the global batch
            ntok = mask.sum().float()
            dist.all_reduce(ntok)
            ntok = ntok / world

            n_mb = seq.size(0) // a.micro
            for j in range(n_mb):
                policy.set_requires_gradient_sync(j == n_mb - 1)
                sl = slice(j * a.micro, (j + 1) * a.micro)
                lp = logps(policy, seq[sl], attn[sl], P)
                ratio = (lp - old[sl]).exp()
                pg = -torch.min(ratio * adv[sl], ratio.clamp(1 - a.clip_lo, 1 + a.clip_hi) * adv[sl])
                d = refl[sl] - lp
                kl = d.exp() - d - 1
                loss = ((pg + a.beta * kl) * mask[sl]).sum() / ntok
                loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            stats = torch.stack([r.mean(), mask.sum(1).float().mean(), (mask.sum(1) == mask.size(1)).float().mean()])
            dist.all_reduce(stats, op=dist.ReduceOp.AVG)
            gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm
            if rank == 0:
                print(f"step {step} reward {stats[0]:.3f} len {stats[1]:.0f} clipped {stats[2]:.2f} "
                      f"gnorm {gnorm.item():.3f} ({time.time() - t0:.0f}s)", flush=True)

            if step % a.save_every == 0 or step == a.steps:
                # resumable sharded checkpoint: every rank writes its shard
                msd, osd = get_state_dict(policy, opt)
                dcp.save({"model": msd, "optim": osd, "step": torch.tensor(step)}, checkpoint_id=latest)
                # consolidated HF weights for eval: gathered on all ranks, written by rank 0
                full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True,
                                                                             cpu_offload=True))
                if rank == 0:
                    out = os.path.join(a.ckpt_dir, f"hf_step{step}")
                    policy.save_pretrained(out, state_dict=full)
                    tok.save_pretrained(out)
                del full
                dist.barrier()
            if step >= a.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
