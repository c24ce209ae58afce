"""Tensor-parallel fine-tuning of a Hugging Face Llama checkpoint with
torch.distributed.tensor.parallel on one 8-GPU node (TP=8, no data parallel).

    torchrun --standalone --nproc_per_node=8 20_dtensor_tp_hf_llama_wandb.py \
        --model meta-llama/Llama-2-7b-hf --data data/tokenized_sft --run-name llama7b-tp8
"""
import argparse
import math
import os
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from datasets import load_from_disk
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM


def tp_plan_for_layer():
    return {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def shard_model(model, mesh):
    tp = mesh.size()
    for layer in model.model.layers:
        attn = layer.self_attn
        # attention reshapes with the per-rank head count
        if hasattr(attn, "num_heads"):
            attn.num_heads //= tp
            attn.num_key_value_heads //= tp
        parallelize_module(layer, mesh, tp_plan_for_layer())
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    return model


def collate(batch, pad_id, max_len):
    L = min(max_len, max(len(b["input_ids"]) for b in batch))
    ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), L), -100, dtype=torch.long)
    for i, b in enumerate(batch):
        x = torch.as_tensor(b["input_ids"][:L])
        lm = torch.as_tensor(b["loss_mask"][:L]).bool()
        ids[i, :len(x)] = x
        labels[i, :len(x)] = x.masked_fill(~lm, -100)
    return ids, labels


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Llama-2-7b-hf")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="out/llama7b_tp8")
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--log-every", type=int, default=10)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("tp",))
    rank = dist.get_rank()

    wandb.init(project="llama-tp-sft", name=args.run_name, config=vars(args))

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    assert model.config.num_attention_heads % world == 0 and model.config.num_key_value_heads % world == 0
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = shard_model(model.cuda(), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))

    ds = load_from_disk(args.data)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    # all ranks form a single tensor-parallel group and must see identical batches:
    # same seed for the shuffle, no sampler
    g = torch.Generator().manual_seed(0)
    dl = DataLoader(ds["train"], batch_size=args.bs, shuffle=True, generator=g, num_workers=2,
                    collate_fn=partial(collate, pad_id=pad_id, max_len=args.max_len), drop_last=True)
    val_dl = DataLoader(ds["validation"], batch_size=args.bs, shuffle=False,
                        collate_fn=partial(collate, pad_id=pad_id, max_len=args.max_len))
    total = args.epochs * len(dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * s / total)))

    step, t0 = 0, time.time()
    for epoch in range(args.epochs):
        model.train()
        for ids, labels in dl:
            ids, labels = ids.cuda(non_blocking=True), labels.cuda(non_blocking=True)
            logits = model(input_ids=ids).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            if step % args.log_every == 0 and rank == 0:
                dt = (time.time() - t0) / args.log_every
                t0 = time.time()
                wandb.log({"train/loss": loss.item(), "train/lr": sched.get_last_lr()[0],
                           "perf/step_time": dt, "epoch": epoch}, step=step)
                print(f"epoch {epoch} step {step}/{total} loss {loss.item():.4f} {dt:.2f}s/step", flush=True)

        model.eval()
        tot = torch.zeros(2, device="cuda")
        with torch.no_grad():
            for ids, labels in val_dl:
                ids, labels = ids.cuda(), labels.cuda()
                logits = model(input_ids=ids).logits
                n = (labels[:, 1:] != -100).sum()
                tot[0] += F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                          ignore_index=-100, reduction="sum")
                tot[1] += n
        val_loss = (tot[0] / tot[1].clamp(min=1)).item()
        if rank == 0:
            wandb.log({"val/loss": val_loss, "val/ppl": math.exp(val_loss)}, step=step)
            print(f"epoch {epoch} val loss {val_loss:.4f}", flush=True)

        # every rank holds different shards: save one file per rank
        os.makedirs(args.out, exist_ok=True)
        sd = {k: (v.to_local() if hasattr(v, "to_local") else v).cpu() for k, v in model.state_dict().items()}
        torch.save(sd, os.path.join(args.out, f"epoch{epoch}_rank{rank:02d}.pt"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
