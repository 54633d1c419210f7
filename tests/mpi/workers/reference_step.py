"""One step of the DeepSpeed workers' single-process reference: the global batch whole (``chunked``
False), or as the ranks' micro-batches each backward on its share of the mean (``chunked`` True);
the two bracket the order noise of a distributed run."""
import torch
import torch.nn.functional as F


def reference_step(model, opt, sched, parts, chunked: bool, clip: float) -> float:
    """Train ``model`` on the (x, y) ``parts`` of one global batch; returns the batch's mean loss."""
    if chunked:
        chunk_losses = [F.mse_loss(model(x), y) for x, y in parts]
        for loss in chunk_losses:
            (loss / len(parts)).backward()
        value = sum(loss.item() for loss in chunk_losses) / len(parts)
    else:
        loss = F.mse_loss(model(torch.cat([x for x, _ in parts])), torch.cat([y for _, y in parts]))
        loss.backward()
        value = loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return value
