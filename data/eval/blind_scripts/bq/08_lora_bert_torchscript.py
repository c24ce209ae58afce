"""LoRA fine-tuning of bert-base on SST-2 with DDP, then merge + TorchScript export for serving.

Only the LoRA matrices (query/value) and the classifier head are trained. Gradient
checkpointing keeps activation memory down so long batches fit on the 24 GB cards.

    torchrun --nproc_per_node=4 08_lora_bert_torchscript.py --output-dir runs/sst2_lora
"""
import argparse
import copy
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding
from transformers import get_linear_schedule_with_warmup


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r: int, alpha: int, dropout: float):
        super().__init__()
        self.base = base
        self.r, self.scaling = r, alpha / r
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout)
        self.merged = False

    def forward(self, x):
        out = self.base(x)
        if self.merged:
            return out
        return out + (self.dropout(x) @ self.lora_A.t() @ self.lora_B.t()) * self.scaling

    @torch.no_grad()
    def merge(self):
        if not self.merged:
            self.base.weight += (self.lora_B @ self.lora_A) * self.scaling
            self.merged = True


def add_lora(model, r, alpha, dropout, targets=("query", "value")):
    for name, module in list(model.named_modules()):
        for t in targets:
            child = getattr(module, t, None)
            if isinstance(child, nn.Linear):
                setattr(module, t, LoRALinear(child, r, alpha, dropout))
    for n, p in model.named_parameters():
        p.requires_grad = ("lora_" in n) or n.startswith("classifier.")
    return model


def trainable_state_dict(model):
    return {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}


class TracedClassifier(nn.Module):
    def __init__(self, hf_model):
        super().__init__()
        self.m = hf_model

    def forward(self, input_ids, attention_mask):
        return self.m(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)[0]


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert-base-uncased")
    ap.add_argument("--output-dir", default="runs/sst2_lora")
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--alpha", type=int, default=16)
    ap.add_argument("--lora-dropout", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)

    def tokenize(batch):
        return tokenizer(batch["sentence"], truncation=True, max_length=args.max_len)

    # rank 0 builds the Arrow cache first; the others then load it instead of re-tokenizing
    if rank != 0:
        dist.barrier()
    raw = load_dataset("glue", "sst2")
    encoded = raw.map(tokenize, batched=True, remove_columns=["sentence", "idx"])
    encoded = encoded.rename_column("label", "labels")
    if rank == 0:
        dist.barrier()
    encoded.set_format("torch")

    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(encoded["train"], shuffle=True, seed=args.seed)
    train_dl = DataLoader(encoded["train"], batch_size=args.batch_size, sampler=train_sampler,
                          collate_fn=collator, num_workers=4, pin_memory=True)
    val_ds = encoded["validation"].shard(num_shards=world, index=rank, contiguous=True)
    val_dl = DataLoader(val_ds, batch_size=128, collate_fn=collator, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2)
    model = add_lora(model, args.r, args.alpha, args.lora_dropout)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    # frozen base weights are skipped by DDP; every trainable tensor is used in each step
    model = DDP(model, device_ids=[local_rank])

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.06 * total), total)
    if rank == 0:
        n_train = sum(p.numel() for p in params)
        print(f"trainable params: {n_train / 1e6:.2f}M, steps: {total}, global batch {args.batch_size * world}")

    best_acc = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}")

        model.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad():
            for batch in val_dl:
                batch = {k: v.to(device) for k, v in batch.items()}
                logits = model.module(**batch).logits
                correct[0] += (logits.argmax(-1) == batch["labels"]).sum()
                correct[1] += batch["labels"].numel()
        dist.all_reduce(correct)
        acc = (correct[0] / correct[1]).item()
        if rank == 0:
            print(f"epoch {epoch}: val acc {acc:.4f}")
            if acc > best_acc:
                best_acc = acc
                os.makedirs(args.output_dir, exist_ok=True)
                torch.save(trainable_state_dict(model.module), os.path.join(args.output_dir, "lora_best.pt"))

    dist.barrier()
    if rank == 0:
        export = copy.deepcopy(model.module).cpu().float().eval()
        best = torch.load(os.path.join(args.output_dir, "lora_best.pt"), map_location="cpu")
        export.load_state_dict(best, strict=False)
        for m in export.modules():
            if isinstance(m, LoRALinear):
                m.merge()
        export.gradient_checkpointing_disable()
        ex = tokenizer(["a gripping, well acted film"], return_tensors="pt", padding="max_length",
                       max_length=args.max_len)
        traced = torch.jit.trace(TracedClassifier(export), (ex["input_ids"], ex["attention_mask"]),
                                 strict=False)
        traced.save(os.path.join(args.output_dir, "sst2_lora_merged.ts"))
        tokenizer.save_pretrained(args.output_dir)
        print(f"best val acc {best_acc:.4f}; TorchScript model written to {args.output_dir}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
