"""
Fine-tune Mistral-7B with LoRA on OpenAssistant top-1 conversations.
Data parallel over the GPUs of one node; only the adapter is trained and saved.

  torchrun --nproc_per_node=4 12_oasst_mistral_lora.py --data data/oasst_top1.jsonl --out runs/oasst-lora
"""
import argparse
import json
import math
import os
import random
from functools import partial

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup

TEMPLATE = "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>\n{{ m['content'] }}</s>\n{% else %}<|assistant|>\n{{ m['content'] }}</s>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="mistralai/Mistral-7B-v0.1")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/oasst-lora")
    ap.add_argument("--val_ratio", type=float, default=0.05)
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--micro_bs", type=int, default=2)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--r", type=int, default=32)
    ap.add_argument("--alpha", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


def encode_conversation(msgs, tok, max_len):
    input_ids, labels = [tok.bos_token_id], [-100]
    for m in msgs:
        if m["role"] == "user":
            ids = tok(f"<|user|>\n{m['content']}", add_special_tokens=False).input_ids + [tok.eos_token_id]
            input_ids += ids + tok("\n", add_special_tokens=False).input_ids
            labels += [-100] * (len(input_ids) - len(labels))
        else:
            head = tok("<|assistant|>\n", add_special_tokens=False).input_ids
            body = tok(m["content"], add_special_tokens=False).input_ids + [tok.eos_token_id]
            input_ids += head + body
            labels += [-100] * len(head) + body
            nl = tok("\n", add_special_tokens=False).input_ids
            input_ids += nl
            labels += [-100] * len(nl)
    return input_ids[:max_len], labels[:max_len]


def collate(batch, pad_id):
    width = max(len(ids) for ids, _ in batch)
    out_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    out_lab = torch.full((len(batch), width), -100, dtype=torch.long)
    out_att = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, lab) in enumerate(batch):
        out_ids[row, : len(ids)] = torch.as_tensor(ids)
        out_lab[row, : len(lab)] = torch.as_tensor(lab)
        out_att[row, : len(ids)] = 1
    return dict(input_ids=out_ids, labels=out_lab, attention_mask=out_att)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    num = torch.zeros((), device=device, dtype=torch.float64)
    den = torch.zeros((), device=device, dtype=torch.float64)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = model(**batch).loss
        ntok = (batch["labels"][:, 1:] != -100).sum()
        num += loss.double() * ntok
        den += ntok
    dist.all_reduce(num)
    dist.all_reduce(den)
    model.train()
    return (num / den).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.base)
    tok.pad_token = tok.unk_token
    tok.chat_template = TEMPLATE

    with open(args.data) as f:
        conversations = [json.loads(l)["messages"] for l in f]
    random.shuffle(conversations)
    n_val = int(len(conversations) * args.val_ratio)
    val_convs, train_convs = conversations[:n_val], conversations[n_val:]
    train_data = [encode_conversation(c, tok, args.max_len) for c in train_convs]
    val_data = [encode_conversation(c, tok, args.max_len) for c in val_convs]
    train_data = [x for x in train_data if any(l != -100 for l in x[1])]
    if rank == 0:
        print(f"{len(train_data)} train / {len(val_data)} val conversations", flush=True)

    coll = partial(collate, pad_id=tok.pad_token_id)
    tr_sampler = DistributedSampler(train_data, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_data, batch_size=args.micro_bs, sampler=tr_sampler, collate_fn=coll,
                              num_workers=2, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_data, batch_size=args.micro_bs, collate_fn=coll,
                            sampler=DistributedSampler(val_data, shuffle=False))

    model = AutoModelForCausalLM.from_pretrained(args.base, torch_dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(
        r=args.r, lora_alpha=args.alpha, lora_dropout=0.05, bias="none", task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model.to(device)
    ddp_model = DDP(model, device_ids=[local_rank])

    params = [p for p in ddp_model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    n_updates = args.epochs * len(train_loader) // args.accum
    sched = get_linear_schedule_with_warmup(optim, num_warmup_steps=int(0.03 * n_updates),
                                            num_training_steps=n_updates)

    best, update = float("inf"), 0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        ddp_model.train()
        for it, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = ddp_model(**batch).loss
            (loss / args.accum).backward()
            if (it + 1) % args.accum != 0:
                continue
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            update += 1
            if update % 25 == 0:
                avg = loss.detach().clone()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} update {update}/{n_updates} loss {avg.item():.4f}", flush=True)

        val_loss = validate(ddp_model, val_loader, device)
        if rank == 0:
            print(f"== epoch {epoch} val loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}", flush=True)
            model.save_pretrained(os.path.join(args.out, f"epoch{epoch}"))
            if val_loss < best:
                best = val_loss
                model.save_pretrained(os.path.join(args.out, "best"))
                tok.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    if rank == 0:
        print(f"done, best val loss {best:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
