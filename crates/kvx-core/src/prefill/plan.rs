//! Per-session chunk planning for the prefill manager: pick the path, slice the destination
//! pages, and build the validated plan (KV, then state and aux on the last chunk).

use super::types::{LocalMemory, PrefillConfig, RoomError, TransferPath};
use crate::layout::{AttentionKind, KvLayout, StateComponent};
use crate::peer::{DecodeRegistration, Destination, SessionId};
use crate::planner::{
    HeadSliceParams, Plan, PlanError, PlanPart, Side, check_span, plan_aux, plan_kv_equal,
    plan_kv_head_slice, plan_state,
};
use crate::{Chunk, Room};

/// A registered decode session and its derived KV layout.
#[derive(Clone, Debug)]
pub(crate) struct Session {
    pub reg: DecodeRegistration,
    pub kv: KvLayout,
    /// The decode takes a 4th failure-reason frame on status messages (sglang 0.5.23): from
    /// its registration's frame 19, or learned from a 5-frame `ABORT` it sent.
    pub status_reason: bool,
    /// Which registration of the manager's this is (set when recorded; a restarted decode's
    /// registration under the same session id gets a new one).
    pub registration: u64,
}

impl Session {
    pub fn new(reg: DecodeRegistration, local: &LocalMemory) -> Self {
        let kv = KvLayout::from_registration(&reg, local.kv.kind, None, local.kv.page_size);
        let status_reason = reg.accepts_status_reason();
        Session {
            reg,
            kv,
            status_reason,
            registration: 0,
        }
    }

    /// True when the decode holds no KV (only aux/state travel).
    pub fn has_kv(&self) -> bool {
        !self.reg.kv_ptrs.is_empty() && self.reg.dst_kv_item_len > 0
    }

    /// The path for this session's KV.
    pub fn path(&self, cfg: &PrefillConfig, local: &LocalMemory) -> TransferPath {
        if !self.has_kv() || local.kv.buffers.is_empty() {
            TransferPath::NoKv
        } else if local.kv.kind == AttentionKind::Mla
            || self.reg.dst_attn_tp_size == cfg.attn_tp_size
        {
            TransferPath::EqualTp
        } else if cfg.staging && self.reg.staging.advertised() {
            TransferPath::Staging
        } else {
            TransferPath::HeadSlice
        }
    }
}

/// What one chunk needs for one session.
pub(crate) struct SessionWork {
    pub path: TransferPath,
    /// Writes to post (KV unless staged, plus state and aux on the last chunk).
    pub plan: Plan,
    /// For the staging path: (source pages, destination pages) of the chunk's KV.
    pub staged: Option<(Vec<i32>, Vec<i32>)>,
    /// Aux rows to send as AUX_DATA messages (last chunk, `aux_over_tcp` only).
    pub aux_rows: Vec<AuxRow>,
}

/// One aux row sent over the control plane.
pub(crate) struct AuxRow {
    pub index: usize,
    pub dst_row: u64,
    pub src_addr: u64,
    pub len: u64,
}

fn plan_err(room: Room, session: &SessionId) -> impl Fn(PlanError) -> RoomError + '_ {
    move |source| RoomError::Plan {
        room,
        session: session.clone(),
        source,
    }
}

/// Plans `chunk` of `room` for one non-dummy session.
pub(crate) fn plan_chunk(
    cfg: &PrefillConfig,
    local: &LocalMemory,
    room: Room,
    session: &Session,
    dst: &Destination,
    chunk: &Chunk,
    aux_row: u64,
) -> Result<SessionWork, RoomError> {
    let sid = &session.reg.session;
    let err = plan_err(room, sid);
    let s = chunk.slice;
    let dst_pages = dst
        .kv_pages
        .get(s.start..s.end)
        .ok_or_else(|| RoomError::SliceOutOfRange {
            room,
            session: sid.clone(),
            start: s.start,
            end: s.end,
            have: dst.kv_pages.len(),
        })?;
    // A longer source list is truncated to the destination (as sglang does); a shorter one is
    // an error in the planner.
    let src_pages = chunk
        .src_pages
        .get(..dst_pages.len())
        .unwrap_or(&chunk.src_pages);
    let mut path = session.path(cfg, local);
    if dst_pages.is_empty() && path != TransferPath::NoKv {
        path = TransferPath::NoKv;
    }
    let mut plan = Plan::new();
    let mut staged = None;
    let mut aux_rows = Vec::new();
    match path {
        TransferPath::NoKv => {}
        TransferPath::EqualTp => {
            let p = plan_kv_equal(&local.kv, &session.kv, src_pages, dst_pages).map_err(&err)?;
            plan.push(PlanPart::Paged(p));
        }
        TransferPath::HeadSlice => {
            let params = HeadSliceParams {
                total_kv_heads: cfg.total_kv_heads,
                src_tp_size: cfg.attn_tp_size,
                src_tp_rank: cfg.attn_tp_rank,
                dst_tp_size: session.reg.dst_attn_tp_size,
                dst_tp_rank: session.reg.dst_tp_rank,
            };
            let p = plan_kv_head_slice(&local.kv, &session.kv, &params, src_pages, dst_pages)
                .map_err(&err)?;
            plan.push(PlanPart::HeadSlice(p));
        }
        TransferPath::Staging => {
            if src_pages.len() != dst_pages.len() {
                return Err(err(PlanError::LengthMismatch {
                    src: src_pages.len(),
                    dst: dst_pages.len(),
                }));
            }
            staged = Some((src_pages.to_vec(), dst_pages.to_vec()));
        }
    }
    if chunk.is_last {
        let equal_tp =
            session.reg.dst_attn_tp_size == cfg.attn_tp_size || local.kv.kind == AttentionKind::Mla;
        for (i, comp) in local.state.iter().enumerate() {
            let (Some(src_idx), Some(dst_idx)) = (chunk.src_state.get(i), dst.state_indices.get(i))
            else {
                continue;
            };
            if src_idx.is_empty() && dst_idx.is_empty() {
                continue;
            }
            if !equal_tp {
                return Err(err(PlanError::HeadSliceConfig(
                    "state components need equal attention TP",
                )));
            }
            let remote = StateComponent::from_registration(&session.reg, i, comp.kind)
                .map_err(|e| err(e.into()))?;
            plan.push(plan_state(comp, &remote, src_idx, dst_idx).map_err(&err)?);
        }
        let dst_row = u64::try_from(dst.aux_index).map_err(|_| RoomError::BadMetadata {
            room,
            session: sid.clone(),
            what: "negative aux index",
        })?;
        if cfg.aux_over_tcp {
            // Rows travel as AUX_DATA messages; the local rows must still be in bounds.
            for (index, b) in local.aux.buffers.iter().enumerate() {
                let src_addr = aux_row
                    .checked_mul(b.item_len)
                    .ok_or(PlanError::OutOfBounds {
                        side: Side::Src,
                        buffer: index,
                        end: u64::MAX,
                        capacity: b.len.unwrap_or(u64::MAX),
                    })
                    .and_then(|off| check_span(Side::Src, index, b.addr, b.len, off, b.item_len))
                    .map_err(&err)?;
                aux_rows.push(AuxRow {
                    index,
                    dst_row,
                    src_addr,
                    len: b.item_len,
                });
            }
        } else {
            let aux =
                plan_aux(&local.aux, aux_row, &session.reg.aux_ptrs, dst_row).map_err(&err)?;
            plan.push(PlanPart::Ops(aux));
        }
    }
    Ok(SessionWork {
        path,
        plan,
        staged,
        aux_rows,
    })
}
