"""GRPO for Python code generation on MBPP with execution-based rewards.

The unit tests are executed on rank 0 only (one process pool per node instead of
one per GPU); completions are gathered to rank 0 and the rewards are scattered back.

    torchrun --nproc_per_node 8 16_grpo_mbpp_code_exec.py --model Qwen/Qwen2.5-Coder-1.5B-Instruct
"""
import argparse
import os
import re
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer

CODE_BLOCK = re.compile(r"```(?:python)?\n(.*?)```", re.S)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-Coder-1.5B-Instruct")
    ap.add_argument("--out_dir", default="runs/grpo_mbpp")
    ap.add_argument("--prompts_per_rank", type=int, default=4)
    ap.add_argument("--group_size", type=int, default=8)
    ap.add_argument("--mb", type=int, default=8)
    ap.add_argument("--max_new_tokens", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--beta", type=float, default=0.02)
    ap.add_argument("--eps", type=float, default=0.2)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--exec_timeout", type=float, default=5.0)
    ap.add_argument("--workers", type=int, default=32)
    return ap.parse_args()


def run_tests(code, tests, timeout):
    program = code + "\n\n" + "\n".join(tests) + "\n"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(program)
        path = f.name
    try:
        proc = subprocess.run(["python3", path], capture_output=True, timeout=timeout)
        return 1.0 if proc.returncode == 0 else 0.0
    except subprocess.TimeoutExpired:
        return 0.0
    finally:
        os.unlink(path)


def score_completion(text, tests, timeout):
    blocks = CODE_BLOCK.findall(text)
    if not blocks:
        return -0.5
    return run_tests(blocks[-1], tests, timeout)


def token_logps(model, ids, attn, P):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, P - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, P:, None]).squeeze(-1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(17 + rank)

    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(dev)
    ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(dev).eval()
    ref.requires_grad_(False)
    policy = DDP(policy, device_ids=[local_rank])
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    pool = ThreadPoolExecutor(args.workers) if rank == 0 else None

    ds = load_dataset("google-research-datasets/mbpp", "full", split="train")
    sampler = DistributedSampler(ds, shuffle=True, seed=5)
    dl = DataLoader(ds, batch_size=args.prompts_per_rank, sampler=sampler, drop_last=True, collate_fn=lambda x: x)

    G = args.group_size
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for rows in dl:
            msgs = [[{"role": "user", "content": f"{r['text']}\nYour code should pass this test:\n{r['test_list'][0]}\n"
                                                 "Return the function in a ```python code block."}] for r in rows]
            chats = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in msgs]
            enc = tok(chats, return_tensors="pt", padding=True).to(dev)
            ids = enc.input_ids.repeat_interleave(G, 0)
            am = enc.attention_mask.repeat_interleave(G, 0)
            P = ids.size(1)

            policy.eval()
            with torch.no_grad():
                seq = policy.module.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=1.0,
                                             top_p=0.95, max_new_tokens=args.max_new_tokens,
                                             pad_token_id=tok.pad_token_id)
                completion_ids = seq[:, P:]
                e = (completion_ids == tok.eos_token_id).int()
                mask = ((e.cumsum(1) - e) == 0).long()
                attn = torch.cat([am, mask], 1)
                old = torch.cat([token_logps(policy.module, seq[i:i + args.mb], attn[i:i + args.mb], P)
                                 for i in range(0, seq.size(0), args.mb)])
                rlp = torch.cat([token_logps(ref, seq[i:i + args.mb], attn[i:i + args.mb], P)
                                 for i in range(0, seq.size(0), args.mb)])
            policy.train()

            # ---- rewards: gather everything on rank 0, execute, scatter back ----
            gathered = [torch.zeros_like(completion_ids) for _ in range(world)]
            dist.all_gather(gathered, completion_ids)
            tests = [[t for t in r["test_list"]] for r in rows]
            all_tests = [None] * world
            dist.all_gather_object(all_tests, tests)
            rewards_all = torch.zeros(world, ids.size(0), device=dev)
            if rank == 0:
                for src in range(world):
                    texts = tok.batch_decode(gathered[src], skip_special_tokens=True)
                    per_sample_tests = [t for t in all_tests[src] for _ in range(G)]
                    futs = [pool.submit(score_completion, x, t, args.exec_timeout)
                            for x, t in zip(texts, per_sample_tests)]
                    rewards_all[src] = torch.tensor([f.result() for f in futs], device=dev)
            dist.broadcast(rewards_all, src=0)
            rewards = rewards_all[rank]

            grp = rewards.view(-1, G)
            adv = ((grp - grp.mean(1, keepdim=True)) / (grp.std(1, keepdim=True) + 1e-4)).view(-1, 1)

            n_mb = (seq.size(0) + args.mb - 1) // args.mb
            denom = mask.sum().clamp(min=1)
            for j in range(n_mb):
                sl = slice(j * args.mb, (j + 1) * args.mb)
                policy.require_backward_grad_sync = j == n_mb - 1
                lp = token_logps(policy, seq[sl], attn[sl], P)
                ratio = (lp - old[sl]).exp()
                pg = -torch.min(ratio * adv[sl], ratio.clamp(1 - args.eps, 1 + args.eps) * adv[sl])
                d = rlp[sl] - lp
                loss = ((pg + args.beta * (d.exp() - d - 1)) * mask[sl]).sum() / denom
                loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if rank == 0:
                pass_rate = (rewards_all == 1.0).float().mean().item()
                print(f"epoch {epoch} step {step} pass@1(sampled) {pass_rate:.3f} "
                      f"mean reward {rewards_all.mean().item():.3f}", flush=True)

        if rank == 0:
            d = os.path.join(args.out_dir, f"epoch{epoch}")
            policy.module.save_pretrained(d)
            tok.save_pretrained(d)
        dist.barrier()

    if pool is not None:
        pool.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
