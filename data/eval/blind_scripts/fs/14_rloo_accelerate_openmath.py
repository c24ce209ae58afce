"""RLOO (REINFORCE leave-one-out) with Hugging Face Accelerate.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 \
        14_rloo_accelerate_openmath.py --model Qwen/Qwen2.5-0.5B-Instruct --output_dir runs/rloo_om2
"""
import argparse
import math
import os

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from datasets import load_dataset
from math_verify import parse, verify
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    p.add_argument("--output_dir", default="runs/rloo")
    p.add_argument("--per_device_prompts", type=int, default=8)
    p.add_argument("--rloo_k", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--response_length", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--kl_coef", type=float, default=0.05)
    p.add_argument("--num_epochs", type=int, default=1)
    p.add_argument("--checkpoint_every", type=int, default=200)
    p.add_argument("--resume_from", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def reward(text, gold):
    try:
        return 1.0 if verify(parse("$" + str(gold) + "$"), parse(text)) else 0.0
    except Exception:
        return 0.0


def sequence_logprob(model, ids, attn, P):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, P - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, P:, None]).squeeze(-1)


def main():
    args = get_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, log_with="tensorboard",
                              project_dir=args.output_dir)
    # same seed everywhere for init/shuffling; sampling gets a per-process offset below
    set_seed(args.seed)
    device = accelerator.device

    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    ref.requires_grad_(False)
    ref.eval().to(device)

    ds = load_dataset("nvidia/OpenMathInstruct-2", split="train_1M")
    ds = ds.filter(lambda r: r["problem_source"] in ("augmented_math", "math"), num_proc=8)
    ds = ds.select_columns(["problem", "expected_answer"])

    def collate(rows):
        chats = [tok.apply_chat_template([{"role": "user", "content": r["problem"] +
                                           "\nPut the final answer in \\boxed{}."}],
                                         tokenize=False, add_generation_prompt=True) for r in rows]
        enc = tok(chats, return_tensors="pt", padding=True)
        enc["answers"] = [r["expected_answer"] for r in rows]
        return enc

    dl = DataLoader(ds, batch_size=args.per_device_prompts, shuffle=True, collate_fn=collate, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-6, weight_decay=0.0)
    updates = math.ceil(len(dl) / accelerator.num_processes / args.grad_accum) * args.num_epochs
    sched = get_scheduler("constant_with_warmup", opt, num_warmup_steps=10 * accelerator.num_processes,
                          num_training_steps=updates * accelerator.num_processes)
    # prepare() shards the dataloader across processes and wraps the model in DDP
    model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)
    accelerator.init_trackers("rloo", config=vars(args))

    start_epoch, skip = 0, 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        done = int(os.path.basename(args.resume_from.rstrip("/")).split("_")[-1])
        start_epoch, skip = divmod(done, len(dl))
    torch.manual_seed(args.seed + 1000 * accelerator.process_index)

    step = start_epoch * len(dl) + skip
    for epoch in range(start_epoch, args.num_epochs):
        dl.set_epoch(epoch)
        active = accelerator.skip_first_batches(dl, skip) if epoch == start_epoch and skip else dl
        for batch in active:
            ids = batch["input_ids"].repeat_interleave(args.rloo_k, 0)
            am = batch["attention_mask"].repeat_interleave(args.rloo_k, 0)
            P = ids.size(1)
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.eval()
            with torch.no_grad():
                seq = unwrapped.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=0.8,
                                         max_new_tokens=args.response_length, pad_token_id=tok.pad_token_id)
                resp = seq[:, P:]
                e = (resp == tok.eos_token_id).int()
                mask = ((e.cumsum(1) - e) == 0).long()
                attn = torch.cat([am, mask], 1)
                ref_lp = sequence_logprob(ref, seq, attn, P)
            unwrapped.train()

            texts = tok.batch_decode(resp, skip_special_tokens=True)
            golds = [a for a in batch["answers"] for _ in range(args.rloo_k)]
            scores = torch.tensor([reward(t, g) for t, g in zip(texts, golds)], device=device)

            with accelerator.accumulate(model):
                lp = sequence_logprob(model, seq, attn, P)
                kl = ((lp.detach() - ref_lp) * mask).sum(1)
                r = (scores - args.kl_coef * kl).view(-1, args.rloo_k)
                baseline = (r.sum(1, keepdim=True) - r) / (args.rloo_k - 1)
                adv = (r - baseline).view(-1)
                loss = -(adv * (lp * mask).sum(1)).mean()
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
            step += 1

            # same-shaped tensors on every process, so a plain gather is fine
            g_scores = accelerator.gather(scores)
            g_kl = accelerator.gather(kl)
            g_len = accelerator.gather(mask.sum(1).float())
            if accelerator.sync_gradients:
                accelerator.log({"reward": g_scores.mean().item(), "kl": g_kl.mean().item(),
                                 "resp_len": g_len.mean().item(), "lr": sched.get_last_lr()[0]}, step=step)

            if step % 50 == 0:
                samples = gather_object([(golds[0], texts[0][-300:])])
                if accelerator.is_main_process:
                    for gold, t in samples[:4]:
                        accelerator.print(f"[gold={gold}] ...{t!r}")

            if step % args.checkpoint_every == 0:
                # save_state must run on every process; it writes once per file
                accelerator.save_state(os.path.join(args.output_dir, f"checkpoint_{step}"))
        skip = 0

    accelerator.wait_for_everyone()
    final = os.path.join(args.output_dir, "final")
    state_dict = accelerator.get_state_dict(model)
    accelerator.unwrap_model(model).save_pretrained(final, is_main_process=accelerator.is_main_process,
                                                    save_function=accelerator.save, state_dict=state_dict)
    if accelerator.is_main_process:
        tok.save_pretrained(final)
    accelerator.end_training()


if __name__ == "__main__":
    main()
