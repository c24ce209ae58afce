"""
REINFORCE++ (global-batch advantage normalisation, k2 KL in the reward) on
NuminaMath with an FSDP2-sharded policy. Rollouts use HF generate() directly
on the sharded model (synced_gpus so that ranks keep stepping together until
the slowest one finishes); rewards are rule-based (boxed answer match).

    torchrun --standalone --nproc_per_node=8 16_reinforcepp_fsdp2_math.py \
        --model Qwen/Qwen2.5-Math-7B --out ckpt/rpp_math7b
"""
import argparse
import os
import re
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from datasets import load_dataset
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-Math-7B")
    p.add_argument("--out", default="ckpt/rpp")
    p.add_argument("--prompts_per_rank", type=int, default=8)
    p.add_argument("--n_samples", type=int, default=4)
    p.add_argument("--micro_batch", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=1024)
    p.add_argument("--kl_coef", type=float, default=0.01)
    p.add_argument("--lr", type=float, default=5e-7)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save_every", type=int, default=50)
    return p.parse_args()


def boxed(s):
    m = re.findall(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}", s)
    return m[-1].replace(" ", "") if m else None


def rule_reward(text, gold):
    pred = boxed(text)
    if pred is None:
        return -0.5
    return 1.0 if pred == gold else -0.2


def logps(model, ids, attn, P):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, P - 1:-1].float()
    return torch.gather(logits.log_softmax(-1), 2, ids[:, P:].unsqueeze(-1)).squeeze(-1)


def main():
    a = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    mesh = init_device_mesh("cuda", (world,))
    N = a.n_samples

    tok = AutoTokenizer.from_pretrained(a.model, padding_side="left")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    policy = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for blk in policy.model.layers:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    fully_shard(policy, mesh=mesh, mp_policy=mp)

    ref = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.bfloat16)
    for blk in ref.model.layers:
        fully_shard(blk, mesh=mesh)
    fully_shard(ref, mesh=mesh)
    ref.eval().requires_grad_(False)

    opt = torch.optim.AdamW(policy.parameters(), lr=a.lr, weight_decay=0.0)

    ds = load_dataset("AI-MO/NuminaMath-CoT", split="train")
    ds = ds.filter(lambda ex: ex["source"] in ("amc_aime", "olympiads", "math") and boxed(ex["solution"]) is not None)

    def fmt(ex):
        msgs = [{"role": "system", "content": "Please reason step by step, and put your final answer within \\boxed{}."},
                {"role": "user", "content": ex["problem"]}]
        return {"prompt": tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                "gold": boxed(ex["solution"])}

    ds = ds.map(fmt, remove_columns=ds.column_names)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    dl = DataLoader(ds, batch_size=a.prompts_per_rank, sampler=sampler, collate_fn=lambda b: b)

    step, epoch = 0, 0
    data = iter(dl)
    sampler.set_epoch(0)
    while step < a.steps:
        try:
            batch = next(data)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            data = iter(dl)
            batch = next(data)
        t0 = time.time()

        enc = tok([b["prompt"] for b in batch], return_tensors="pt", padding=True).to(dev)
        P = enc.input_ids.shape[1]
        policy.eval()
        with torch.no_grad():
            seqs = policy.generate(**enc, do_sample=True, temperature=1.0, max_new_tokens=a.max_new_tokens,
                                   num_return_sequences=N, pad_token_id=tok.pad_token_id, synced_gpus=True,
                                   use_cache=True)
        policy.train()
        comp = seqs[:, P:]
        hit = comp == tok.eos_token_id
        cmask = (hit.int().cumsum(1) - hit.int() == 0).float()
        attn = torch.cat([enc.attention_mask.repeat_interleave(N, 0), cmask.long()], 1)

        texts = tok.batch_decode(comp, skip_special_tokens=True)
        reward_list = [rule_reward(t, batch[i // N]["gold"]) for i, t in enumerate(texts)]
        rewards = torch.tensor(reward_list, dtype=torch.float32)

        with torch.no_grad():
            old_lp, ref_lp = [], []
            for s in range(0, seqs.shape[0], a.micro_batch):
                old_lp.append(logps(policy, seqs[s:s + a.micro_batch], attn[s:s + a.micro_batch], P))
                ref_lp.append(logps(ref, seqs[s:s + a.micro_batch], attn[s:s + a.micro_batch], P))
            old_lp, ref_lp = torch.cat(old_lp), torch.cat(ref_lp)

        # sequence return = outcome reward - k2 KL summed over the completion
        kl_seq = (0.5 * (old_lp - ref_lp) ** 2 * cmask).sum(1).cpu()
        returns = rewards - a.kl_coef * kl_seq

        # global normalisation over every sample in the step (REINFORCE++)
        moments = torch.stack([returns.sum(), (returns ** 2).sum(), torch.tensor(float(returns.numel()))]).double()
        dist.all_reduce(moments)
        mean = moments[0] / moments[2]
        std = (moments[1] / moments[2] - mean ** 2).clamp(min=1e-8).sqrt()
        adv = ((returns - mean) / std).float().to(dev)

        n_tok = cmask.sum()
        opt.zero_grad(set_to_none=True)
        n_micro = (seqs.shape[0] + a.micro_batch - 1) // a.micro_batch
        for j, s in enumerate(range(0, seqs.shape[0], a.micro_batch)):
            sl = slice(s, s + a.micro_batch)
            policy.set_requires_gradient_sync(j == n_micro - 1)
            lp = logps(policy, seqs[sl], attn[sl], P)
            ratio = torch.exp(lp - old_lp[sl])
            adv_t = adv[sl].unsqueeze(1)
            surr = torch.min(ratio * adv_t, ratio.clamp(1 - a.clip, 1 + a.clip) * adv_t)
            loss = -(surr * cmask[sl]).sum() / n_tok
            loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0).full_tensor()
        opt.step()
        step += 1

        log = torch.stack([rewards.mean(), (rewards == 1.0).float().mean(), kl_seq.mean()]).to(dev)
        log = torch.cat([log, cmask.sum(1).mean().view(1)])
        dist.all_reduce(log, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"step {step} reward {log[0]:.3f} acc {log[1]:.3f} kl {log[2]:.4f} len {log[3]:.0f} "
                  f"gn {gn.item():.3f} {time.time() - t0:.0f}s", flush=True)

        if step % a.save_every == 0:
            msd, osd = get_state_dict(policy, opt)
            dcp.save({"model": msd, "optim": osd, "step": step}, checkpoint_id=os.path.join(a.out, f"step_{step}"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
