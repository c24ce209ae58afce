"""
LoRA SFT of Mistral-7B-Instruct-v0.3 for the claims-triage assistant.

Launched by the platform's "torchrun" job type (one pod, 8x A100-80G):

    torchrun --standalone --nproc_per_node=8 sft_lora.py \
        --train /mnt/data/claims_sft/train.jsonl --eval /mnt/data/claims_sft/eval.jsonl \
        --out /mnt/output/mistral7b-claims-lora-r64 --epochs 3

Each line of the jsonl is {"prompt": ..., "response": ...}.  Only the LoRA adapter is saved;
the merged model is built later by the packaging pipeline.
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import wandb
from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mistralai/Mistral-7B-Instruct-v0.3")
    ap.add_argument("--train", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--lora-r", type=int, default=64)
    return ap.parse_args()


def build_tokenize(tok, max_len):
    def fn(ex):
        prompt = tok.apply_chat_template([{"role": "user", "content": ex["prompt"]}], tokenize=False,
                                         add_generation_prompt=True)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        r_ids = tok(ex["response"] + tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = (p_ids + r_ids)[:max_len]
        labels = ([-100] * len(p_ids) + r_ids)[:max_len]
        return {"input_ids": ids, "labels": labels}
    return fn


def pad_collate(pad_id):
    def collate(rows):
        n = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), n), pad_id)
        lab = torch.full((len(rows), n), -100)
        att = torch.zeros((len(rows), n), dtype=torch.long)
        for i, r in enumerate(rows):
            k = len(r["input_ids"])
            ids[i, :k] = torch.tensor(r["input_ids"])
            lab[i, :k] = torch.tensor(r["labels"])
            att[i, :k] = 1
        return ids, att, lab
    return collate


@torch.no_grad()
def eval_loss(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for ids, att, lab in loader:
        ids, att, lab = ids.to(device), att.to(device), lab.to(device)
        out = model(input_ids=ids, attention_mask=att, labels=lab)
        n = (lab[:, 1:] != -100).sum()
        acc += torch.stack([out.loss.float() * n, n.float()])
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.pad_token or tok.unk_token
    raw = load_dataset("json", data_files={"train": args.train, "eval": args.eval})
    # rank 0 builds the Arrow cache first, the others then load it
    if rank != 0:
        dist.barrier()
    ds = raw.map(build_tokenize(tok, args.max_len), remove_columns=["prompt", "response"], num_proc=8)
    if rank == 0:
        dist.barrier()

    model = AutoModelForCausalLM.from_pretrained(
        args.model, torch_dtype=torch.bfloat16, device_map="auto", attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.05, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, lora)
    if rank == 0:
        model.print_trainable_parameters()
    model = DDP(model, device_ids=[local_rank])

    sampler = DistributedSampler(ds["train"], shuffle=True, seed=0)
    train_dl = DataLoader(ds["train"], batch_size=args.bs, sampler=sampler, collate_fn=pad_collate(tok.pad_token_id),
                          num_workers=2, drop_last=True)
    eval_dl = DataLoader(ds["eval"], batch_size=args.bs,
                         sampler=DistributedSampler(ds["eval"], shuffle=False, drop_last=True),
                         collate_fn=pad_collate(tok.pad_token_id), num_workers=2)

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    total = math.ceil(len(train_dl) / args.accum) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * total), total)

    if rank == 0:
        wandb.init(project="claims-triage-llm", name=os.path.basename(args.out), config=vars(args))

    update = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, (ids, att, lab) in enumerate(train_dl):
            ids, att, lab = ids.to(device), att.to(device), lab.to(device)
            boundary = (i + 1) % args.accum == 0
            if boundary:
                loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
                (loss / args.accum).backward()
            else:
                with model.no_sync():
                    loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
                    (loss / args.accum).backward()
                continue
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            update += 1
            if rank == 0 and update % 10 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": sched.get_last_lr()[0], "epoch": epoch}, step=update)

        el = eval_loss(model, eval_dl, device)
        if rank == 0:
            wandb.log({"eval/loss": el, "eval/ppl": math.exp(el)}, step=update)
            model.module.save_pretrained(os.path.join(args.out, f"epoch{epoch}"))
            tok.save_pretrained(os.path.join(args.out, f"epoch{epoch}"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
