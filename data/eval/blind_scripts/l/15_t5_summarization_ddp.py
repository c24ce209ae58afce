"""
Flan-T5-large fine-tuning for meeting-summary generation, DDP, bf16 autocast.
Validation = loss on the dev split; ROUGE is computed offline on the saved checkpoints.

Launch (single node, 8 GPUs):
    torchrun --standalone --nproc_per_node=8 15_t5_summarization_ddp.py --epochs 8
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq
from transformers.optimization import Adafactor

SRC_LEN, TGT_LEN = 1024, 192


def args_():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="google/flan-t5-large")
    ap.add_argument("--dataset", default="knkarthick/dialogsum")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--out", default="ckpt/flan_t5_dialogsum")
    ap.add_argument("--patience", type=int, default=2)
    return ap.parse_args()


def preprocess(batch, tok):
    inputs = ["summarize: " + d for d in batch["dialogue"]]
    enc = tok(inputs, max_length=SRC_LEN, truncation=True)
    enc["labels"] = tok(text_target=batch["summary"], max_length=TGT_LEN, truncation=True)["input_ids"]
    return enc


def setup_dist():
    lr = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr)
    dist.init_process_group("nccl", device_id=torch.device("cuda", lr))
    return dist.get_rank(), dist.get_world_size(), lr


@torch.no_grad()
def dev_loss(model, loader, device):
    model.eval()
    t = torch.zeros(2, device=device)
    for b in loader:
        b = {k: v.to(device) for k, v in b.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**b)
        n = (b["labels"] != -100).sum()
        t[0] += out.loss.float() * n
        t[1] += n
    dist.all_reduce(t)
    model.train()
    return (t[0] / t[1]).item()


def main():
    args = args_()
    rank, world, local_rank = setup_dist()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    tok = AutoTokenizer.from_pretrained(args.model)
    if rank == 0:
        ds = load_dataset(args.dataset)
        ds = ds.map(preprocess, fn_kwargs={"tok": tok}, batched=True,
                    remove_columns=ds["train"].column_names)
    dist.barrier()
    if rank != 0:
        ds = load_dataset(args.dataset)
        ds = ds.map(preprocess, fn_kwargs={"tok": tok}, batched=True,
                    remove_columns=ds["train"].column_names)

    model = AutoModelForSeq2SeqLM.from_pretrained(args.model).to(device)
    collator = DataCollatorForSeq2Seq(tok, model=model, label_pad_token_id=-100,
                                      pad_to_multiple_of=8)

    train_sampler = DistributedSampler(ds["train"], num_replicas=world, rank=rank, shuffle=True)
    dev_sampler = DistributedSampler(ds["validation"], num_replicas=world, rank=rank,
                                     shuffle=False, drop_last=True)
    train_dl = DataLoader(ds["train"], batch_size=args.bs, sampler=train_sampler,
                          collate_fn=collator, num_workers=4, pin_memory=True, drop_last=True)
    dev_dl = DataLoader(ds["validation"], batch_size=args.bs * 2, sampler=dev_sampler,
                        collate_fn=collator, num_workers=2)

    model = DDP(model, device_ids=[local_rank])
    optim = Adafactor(model.parameters(), lr=args.lr, scale_parameter=False,
                      relative_step=False, warmup_init=False)

    best, bad_epochs = float("inf"), 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros((), device=device)
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            optim.zero_grad(set_to_none=True)
            running += loss.detach()
            if (step + 1) % 50 == 0:
                dist.all_reduce(running, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} [{step + 1}/{len(train_dl)}] "
                          f"loss {running.item() / 50:.4f}", flush=True)
                running.zero_()

        dl = dev_loss(model.module, dev_dl, device)
        stop = torch.zeros(1, device=device)
        if rank == 0:
            print(f"epoch {epoch} dev_loss {dl:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if dl < best:
                best, bad_epochs = dl, 0
                model.module.save_pretrained(args.out)
                tok.save_pretrained(args.out)
            else:
                bad_epochs += 1
                if bad_epochs >= args.patience:
                    print("early stopping", flush=True)
                    stop += 1
        dist.broadcast(stop, src=0)
        if stop.item() > 0:
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
