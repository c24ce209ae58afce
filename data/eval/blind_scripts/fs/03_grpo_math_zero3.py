# GRPO with DeepSpeed ZeRO-3 for 7B-class policies on competition math.
#
#   deepspeed --num_gpus 8 03_grpo_math_zero3.py --model deepseek-ai/deepseek-math-7b-instruct
#
# Policy and reference are both ZeRO-3 partitioned (the reference through an
# inference-only engine), so a 7B policy + 7B reference + Adam fit on 8x80GB.
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
from transformers.integrations import HfDeepSpeedConfig

BOXED = re.compile(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", default="hendrycks/competition_math")
    ap.add_argument("--out", default="ckpt/grpo_math_z3")
    ap.add_argument("--prompts_per_rank", type=int, default=2)
    ap.add_argument("--group_size", type=int, default=8)
    ap.add_argument("--micro_bs", type=int, default=4)
    ap.add_argument("--max_new_tokens", type=int, default=768)
    ap.add_argument("--lr", type=float, default=5e-7)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--eps", type=float, default=0.2)
    ap.add_argument("--total_steps", type=int, default=500)
    ap.add_argument("--save_interval", type=int, default=50)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--local_rank", type=int, default=-1)  # filled in by the deepspeed launcher
    return ap.parse_args()


def normalize(ans):
    ans = ans.strip().replace(" ", "").replace("\\!", "").replace("$", "")
    ans = ans.replace("\\left", "").replace("\\right", "").replace("dfrac", "frac")
    return ans.rstrip(".")


def last_boxed(text):
    found = BOXED.findall(text)
    return normalize(found[-1]) if found else None


def correctness_reward(completions, solutions):
    rewards = []
    for c, sol in zip(completions, solutions):
        pred, gold = last_boxed(c), last_boxed(sol)
        rewards.append(1.0 if pred is not None and pred == gold else 0.0)
    return rewards


def per_token_logps(model, ids, attn, n_prompt):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, n_prompt - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, n_prompt:, None]).squeeze(-1)


def main():
    args = parse()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1000 + rank)  # different samples per rank, same init everywhere (weights come from disk)

    n_seq = args.prompts_per_rank * args.group_size
    assert n_seq % args.micro_bs == 0
    grad_accum = n_seq // args.micro_bs
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": args.micro_bs * grad_accum * world,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.99], "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                      "warmup_num_steps": 20}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 1000000,
    }
    ref_config = {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e5},
    }
    # must stay alive while from_pretrained runs so the weights are partitioned on load
    dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token

    policy = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    policy.config.use_cache = True
    engine, _, _, _ = deepspeed.initialize(model=policy, model_parameters=policy.parameters(), config=ds_config)

    ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    ref_engine, *_ = deepspeed.initialize(model=ref, config=ref_config)
    ref_engine.eval()

    data = load_dataset(args.data, split="train")
    data = data.filter(lambda r: r["level"] in ("Level 3", "Level 4", "Level 5"))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=17)
    loader = DataLoader(data, batch_size=args.prompts_per_rank, sampler=sampler, drop_last=True,
                        collate_fn=lambda rows: rows)

    step = 0
    if args.resume and os.path.isdir(args.out):
        _, client = engine.load_checkpoint(args.out)
        if client is not None:
            step = client.get("step", 0)

    epoch = step // len(loader)
    sampler.set_epoch(epoch)
    data_iter = iter(loader)
    for _ in range(step % len(loader)):
        next(data_iter)

    while step < args.total_steps:
        try:
            rows = next(data_iter)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            data_iter = iter(loader)
            rows = next(data_iter)

        prompts = [tok.apply_chat_template([{"role": "user", "content": r["problem"] +
                                             "\nPlease reason step by step, and put your final answer within \\boxed{}."}],
                                           tokenize=False, add_generation_prompt=True) for r in rows]
        enc = tok(prompts, return_tensors="pt", padding=True).to(device)
        p_ids = enc.input_ids.repeat_interleave(args.group_size, 0)
        p_mask = enc.attention_mask.repeat_interleave(args.group_size, 0)
        P = p_ids.size(1)

        engine.eval()
        with torch.no_grad():
            # every rank must take part in every forward while the parameters are sharded
            out = engine.module.generate(input_ids=p_ids, attention_mask=p_mask, do_sample=True,
                                         temperature=0.9, max_new_tokens=args.max_new_tokens,
                                         pad_token_id=tok.pad_token_id, synced_gpus=True)
            comp = out[:, P:]
            is_eos = comp == tok.eos_token_id
            eos_pos = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], comp.size(1), dtype=torch.long))
            c_mask = (torch.arange(comp.size(1), device=device)[None] <= eos_pos[:, None]).long()
            attn = torch.cat([p_mask, c_mask], 1)

            old_lp, ref_lp = [], []
            for s in range(0, n_seq, args.micro_bs):
                old_lp.append(per_token_logps(engine, out[s:s + args.micro_bs], attn[s:s + args.micro_bs], P))
                ref_lp.append(per_token_logps(ref_engine, out[s:s + args.micro_bs], attn[s:s + args.micro_bs], P))
            old_lp, ref_lp = torch.cat(old_lp), torch.cat(ref_lp)
        engine.train()

        texts = tok.batch_decode(comp, skip_special_tokens=True)
        sols = [r["solution"] for r in rows for _ in range(args.group_size)]
        r = torch.tensor(correctness_reward(texts, sols), device=device).view(-1, args.group_size)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1, 1)

        # a batch where every group has zero variance still goes through backward
        # (zero policy gradient, only the KL term) so all ranks step together
        kl_sum = torch.zeros((), device=device)
        for s in range(0, n_seq, args.micro_bs):
            sl = slice(s, s + args.micro_bs)
            lp = per_token_logps(engine, out[sl], attn[sl], P)
            m = c_mask[sl].float()
            ratio = (lp - old_lp[sl]).exp()
            pg = -torch.min(ratio * adv[sl], ratio.clamp(1 - args.eps, 1 + args.eps) * adv[sl])
            d = ref_lp[sl] - lp
            kl = d.exp() - d - 1
            loss = (((pg + args.beta * kl) * m).sum(1) / m.sum(1).clamp(min=1)).mean()
            engine.backward(loss)
            engine.step()
            kl_sum += ((kl * m).sum() / m.sum().clamp(min=1)).detach()
        step += 1

        metrics = torch.stack([r.mean(), kl_sum / grad_accum, c_mask.sum(1).float().mean()])
        dist.all_reduce(metrics, op=dist.ReduceOp.SUM)
        metrics /= world
        if rank == 0:
            print(json.dumps({"step": step, "reward": round(metrics[0].item(), 4),
                              "kl": round(metrics[1].item(), 5), "resp_len": round(metrics[2].item(), 1),
                              "lr": engine.get_lr()[0]}), flush=True)

        if step % args.save_interval == 0 or step == args.total_steps:
            # collective: every rank writes its own ZeRO shard
            engine.save_checkpoint(args.out, tag=f"step{step}", client_state={"step": step})
            export_dir = os.path.join(args.out, f"hf_step{step}")
            engine.save_16bit_model(export_dir)
            if rank == 0:
                tok.save_pretrained(export_dir)
                engine.module.config.save_pretrained(export_dir)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
