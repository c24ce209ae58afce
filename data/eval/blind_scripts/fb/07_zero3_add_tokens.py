"""Chat-format fine-tuning with new special tokens, DeepSpeed ZeRO-3 (+ optional param offload).

torchrun --nproc_per_node 8 zero3_add_tokens.py --model meta-llama/Meta-Llama-3-8B \
    --train data/chat_train.jsonl --valid data/chat_valid.jsonl --out /shared/ckpt/l3-chat
"""
import argparse
import json
import math
import os

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations import HfDeepSpeedConfig

SPECIAL_TOKENS = ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--accum", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seq_len", type=int, default=4096)
    ap.add_argument("--offload_params", action="store_true")
    return ap.parse_args()


class ChatDataset(Dataset):
    def __init__(self, path, tok, seq_len):
        self.tok, self.seq_len = tok, seq_len
        with open(path) as f:
            self.convs = [json.loads(l)["messages"] for l in f if l.strip()]

    def __len__(self):
        return len(self.convs)

    def __getitem__(self, i):
        ids, labels = [self.tok.bos_token_id], [-100]
        for m in self.convs[i]:
            head = self.tok(f"<|{m['role']}|>\n", add_special_tokens=False)["input_ids"]
            body = self.tok(m["content"] + "<|end|>", add_special_tokens=False)["input_ids"]
            ids += head + body
            labels += [-100] * len(head) + (body if m["role"] == "assistant" else [-100] * len(body))
        return torch.tensor(ids[: self.seq_len]), torch.tensor(labels[: self.seq_len])


def pad_collate(pad_id):
    def f(batch):
        n = max(x.numel() for x, _ in batch)
        ids = torch.full((len(batch), n), pad_id)
        lab = torch.full((len(batch), n), -100)
        for i, (x, y) in enumerate(batch):
            ids[i, : x.numel()] = x
            lab[i, : y.numel()] = y
        return ids, lab, (ids != pad_id).long()
    return f


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    ds_config = {
        "train_micro_batch_size_per_gpu": args.mbs,
        "gradient_accumulation_steps": args.accum,
        "train_batch_size": args.mbs * args.accum * world,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": True,
            "offload_param": {"device": "cpu" if args.offload_params else "none"},
        },
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "steps_per_print": 100,
    }
    dschf = HfDeepSpeedConfig(ds_config)  # keep a reference: enables zero.Init inside from_pretrained

    tok = AutoTokenizer.from_pretrained(args.model)
    old_vocab = len(tok)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    if tok.pad_token is None:
        tok.pad_token = "<|end|>"

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.resize_token_embeddings(len(tok), pad_to_multiple_of=64)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    # new rows start at the mean of the old embeddings; params are partitioned, so gather them first
    in_emb = model.get_input_embeddings().weight
    out_emb = model.get_output_embeddings().weight
    with deepspeed.zero.GatheredParameters([in_emb, out_emb], modifier_rank=0):
        if rank == 0:
            for w in (in_emb, out_emb):
                w.data[old_vocab:] = w.data[:old_vocab].mean(dim=0, keepdim=True)

    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    if rank == 0:
        print(f"params: {n_params / 1e9:.2f}B, vocab {old_vocab} -> {len(tok)}", flush=True)

    train_ds = ChatDataset(args.train, tok, args.seq_len)
    valid_ds = ChatDataset(args.valid, tok, args.seq_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=11)
    train_dl = DataLoader(train_ds, batch_size=args.mbs, sampler=train_sampler,
                          collate_fn=pad_collate(tok.pad_token_id), num_workers=4)
    valid_dl = DataLoader(valid_ds, batch_size=args.mbs, sampler=DistributedSampler(valid_ds, shuffle=False),
                          collate_fn=pad_collate(tok.pad_token_id), num_workers=2)

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    start_epoch = 0
    if os.path.exists(os.path.join(args.out, "latest")):
        _, cs = engine.load_checkpoint(args.out)
        start_epoch = cs["next_epoch"]

    best = float("inf")
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        engine.train()
        for ids, lab, att in train_dl:
            out = engine(input_ids=ids.to(engine.device), attention_mask=att.to(engine.device),
                         labels=lab.to(engine.device))
            engine.backward(out.loss)
            engine.step()
            if engine.is_gradient_accumulation_boundary() and rank == 0 and engine.global_steps % 20 == 0:
                print(f"epoch {epoch} step {engine.global_steps} loss {out.loss.item():.4f}", flush=True)

        # every rank runs the same number of forwards (ZeRO-3 gathers layers collectively), so the
        # sampler's padding stays, but its repeated samples get zero weight in the sums
        engine.eval()
        tot = torch.zeros(2, device=engine.device)
        seen = 0
        with torch.no_grad():
            for ids, lab, att in valid_dl:
                lab = lab.to(engine.device)
                logits = engine(input_ids=ids.to(engine.device), attention_mask=att.to(engine.device)).logits
                pos = rank + world * torch.arange(seen, seen + ids.size(0), device=engine.device)
                seen += ids.size(0)
                tgt = lab[:, 1:]
                mask = (tgt != -100) & (pos < len(valid_ds)).unsqueeze(1)
                nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), tgt.clamp(min=0), reduction="none")
                tot += torch.stack([(nll * mask).sum(), mask.sum().float()])
        dist.all_reduce(tot)
        val_loss = (tot[0] / tot[1]).item()
        if rank == 0:
            print(f"[valid] epoch {epoch} loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}", flush=True)

        engine.save_checkpoint(args.out, tag=f"epoch{epoch}", client_state={"next_epoch": epoch + 1})
        if val_loss < best:
            best = val_loss
            # collective under ZeRO-3: all ranks call it, rank 0 writes the consolidated file
            engine.save_16bit_model(os.path.join(args.out, "best"), "pytorch_model.bin")
            if rank == 0:
                tok.save_pretrained(os.path.join(args.out, "best"))
                model.config.save_pretrained(os.path.join(args.out, "best"))
                with open(os.path.join(args.out, "best", "val.json"), "w") as f:
                    json.dump({"epoch": epoch, "val_loss": val_loss}, f)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
