"""LoRA-GRPO for text-to-SQL (sql-create-context).

The reference policy is the base model itself: we run it by temporarily disabling
the LoRA adapter, so no second copy of the weights is needed.

    torchrun --nproc_per_node=4 17_grpo_lora_text2sql.py --base mistralai/Mistral-7B-Instruct-v0.3 --save_dir /nfs/rl/sql_lora
"""
import argparse
import os
import re
import time
from contextlib import nullcontext

import sqlglot
import torch
import torch.distributed as dist
from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="mistralai/Mistral-7B-Instruct-v0.3")
    ap.add_argument("--save_dir", default="runs/sql_lora")
    ap.add_argument("--lora_r", type=int, default=32)
    ap.add_argument("--lora_alpha", type=int, default=64)
    ap.add_argument("--per_rank_prompts", type=int, default=4)
    ap.add_argument("--G", type=int, default=6)
    ap.add_argument("--mb", type=int, default=6)
    ap.add_argument("--max_new_tokens", type=int, default=160)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--beta", type=float, default=0.05)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--save_steps", type=int, default=100)
    return ap.parse_args()


def canon(sql):
    try:
        return sqlglot.transpile(sql, read="sqlite", write="sqlite", pretty=False, normalize=True)[0].lower()
    except Exception:
        return None


def sql_reward(completion, gold):
    m = re.search(r"```sql\s*(.*?)```", completion, re.S)
    if m is None:
        return 0.0
    pred = canon(m.group(1).strip().rstrip(";"))
    if pred is None:
        return 0.1
    return 1.0 if pred == canon(gold) else 0.2


def token_logps(model, ids, attn, P):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, P - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, P:, None]).squeeze(-1)


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(rank)

    tok = AutoTokenizer.from_pretrained(args.base, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.unk_token
    base = AutoModelForCausalLM.from_pretrained(args.base, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    lcfg = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(base, lcfg).to(dev)
    if rank == 0:
        model.print_trainable_parameters()
    model = DDP(model, device_ids=[local_rank])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)

    ds = load_dataset("b-mc2/sql-create-context", split="train")
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=args.per_rank_prompts, sampler=sampler, drop_last=True, collate_fn=lambda x: x)

    def make_prompt(r):
        return tok.apply_chat_template([{"role": "user", "content":
                                         f"Schema:\n{r['context']}\n\nQuestion: {r['question']}\n"
                                         "Write one SQLite query in a ```sql block."}],
                                       tokenize=False, add_generation_prompt=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for rows in dl:
            t0 = time.time()
            enc = tok([make_prompt(r) for r in rows], return_tensors="pt", padding=True,
                      add_special_tokens=False).to(dev)
            ids = enc.input_ids.repeat_interleave(args.G, 0)
            am = enc.attention_mask.repeat_interleave(args.G, 0)
            P = ids.size(1)

            model.eval()
            with torch.no_grad():
                seq = model.module.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=0.8,
                                            max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id)
                resp = seq[:, P:]
                e = (resp == tok.eos_token_id).int()
                mask = ((e.cumsum(1) - e) == 0).long()
                attn = torch.cat([am, mask], 1)
                old_lp, ref_lp = [], []
                for i in range(0, seq.size(0), args.mb):
                    old_lp.append(token_logps(model.module, seq[i:i + args.mb], attn[i:i + args.mb], P))
                    with model.module.disable_adapter():
                        ref_lp.append(token_logps(model.module, seq[i:i + args.mb], attn[i:i + args.mb], P))
                old_lp, ref_lp = torch.cat(old_lp), torch.cat(ref_lp)
            model.train()

            texts = tok.batch_decode(resp, skip_special_tokens=True)
            rew = torch.tensor([sql_reward(t, r["answer"]) for t, r in
                                zip(texts, [r for r in rows for _ in range(args.G)])], device=dev)
            g = rew.view(-1, args.G)
            adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).view(-1, 1)

            n_mb = seq.size(0) // args.mb
            denom = mask.sum().clamp(min=1)
            for j in range(n_mb):
                sl = slice(j * args.mb, (j + 1) * args.mb)
                with model.no_sync() if j < n_mb - 1 else nullcontext():
                    lp = token_logps(model, seq[sl], attn[sl], P)
                    ratio = (lp - old_lp[sl]).exp()
                    pg = -torch.min(ratio * adv[sl], ratio.clamp(1 - args.clip, 1 + args.clip) * adv[sl])
                    d = ref_lp[sl] - lp
                    loss = ((pg + args.beta * (d.exp() - d - 1)) * mask[sl]).sum() / denom
                    loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            stats = torch.stack([rew.mean(), (rew == 1.0).float().mean(), mask.sum(1).float().mean()])
            dist.all_reduce(stats)
            stats /= world
            if rank == 0 and step % 10 == 0:
                print(f"[ep{epoch} step{step}] reward={stats[0]:.3f} exact={stats[1]:.3f} "
                      f"len={stats[2]:.0f} t={time.time() - t0:.1f}s", flush=True)

            if step % args.save_steps == 0:
                ckpt = os.path.join(args.save_dir, f"checkpoint-{step}")
                model.module.save_pretrained(ckpt)
                tok.save_pretrained(ckpt)
                torch.save({"optimizer": opt.state_dict(), "step": step, "epoch": epoch},
                           os.path.join(ckpt, "trainer_state.pt"))
                dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.save_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
