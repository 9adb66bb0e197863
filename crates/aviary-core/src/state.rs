//! The sandbox lifecycle state machine (DESIGN §4).
//!
//! [`SandboxState::can_transition_to`] is the single definition of which moves
//! are legal; the registry refuses every other move, so no caller can put a
//! sandbox into a state the design does not allow.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub enum SandboxState {
    Requested,
    Planning,
    Allocating,
    Provisioning,
    Locking,
    Ready,
    Leased,
    Running,
    Idle,
    ReuseChecking,
    Recycling,
    Hibernating,
    Sanitizing,
    Terminated,
    Failed,
    Lost,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StateError {
    #[error("illegal transition {from} -> {to}")]
    IllegalTransition {
        from: SandboxState,
        to: SandboxState,
    },
    #[error("unknown state {0:?}")]
    UnknownState(String),
}

use SandboxState::*;

impl SandboxState {
    pub const ALL: [SandboxState; 16] = [
        Requested,
        Planning,
        Allocating,
        Provisioning,
        Locking,
        Ready,
        Leased,
        Running,
        Idle,
        ReuseChecking,
        Recycling,
        Hibernating,
        Sanitizing,
        Terminated,
        Failed,
        Lost,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Requested => "Requested",
            Planning => "Planning",
            Allocating => "Allocating",
            Provisioning => "Provisioning",
            Locking => "Locking",
            Ready => "Ready",
            Leased => "Leased",
            Running => "Running",
            Idle => "Idle",
            ReuseChecking => "ReuseChecking",
            Recycling => "Recycling",
            Hibernating => "Hibernating",
            Sanitizing => "Sanitizing",
            Terminated => "Terminated",
            Failed => "Failed",
            Lost => "Lost",
        }
    }

    /// No transition leaves a terminal state.
    pub fn is_terminal(self) -> bool {
        matches!(self, Terminated)
    }

    /// States in which the sandbox's compute exists and can run commands.
    pub fn is_live(self) -> bool {
        matches!(self, Ready | Leased | Running | Idle | ReuseChecking)
    }

    /// The legal successors of this state.
    pub fn successors(self) -> &'static [SandboxState] {
        match self {
            Requested => &[Planning, Failed, Terminated],
            Planning => &[Allocating, Failed, Terminated],
            // warm hit goes straight to Locking, a miss provisions first
            Allocating => &[Locking, Provisioning, Failed, Terminated],
            // a pool refill provisions straight into Ready
            Provisioning => &[Locking, Ready, Failed, Terminated],
            // an unleased create settles in Idle without a lease
            Locking => &[Leased, Idle, Ready, Failed, Terminated],
            Ready => &[Locking, Sanitizing, Failed, Lost, Terminated],
            Leased => &[Running, Idle, Sanitizing, Failed, Lost],
            Running => &[Idle, Leased, Failed, Lost],
            Idle => &[
                ReuseChecking,
                Leased,
                Running,
                Hibernating,
                Sanitizing,
                Recycling,
                Failed,
                Lost,
            ],
            ReuseChecking => &[Leased, Idle, Recycling, Failed],
            Recycling => &[Sanitizing, Provisioning, Idle, Failed, Terminated],
            Hibernating => &[Provisioning, Sanitizing, Failed, Terminated],
            Sanitizing => &[Ready, Idle, Terminated, Failed],
            Failed => &[Sanitizing, Terminated],
            Lost => &[Provisioning, Sanitizing, Terminated],
            Terminated => &[],
        }
    }

    pub fn can_transition_to(self, to: SandboxState) -> bool {
        self.successors().contains(&to)
    }

    /// `Ok(to)` when the move is legal.
    pub fn transition(self, to: SandboxState) -> Result<SandboxState, StateError> {
        if self.can_transition_to(to) {
            Ok(to)
        } else {
            Err(StateError::IllegalTransition { from: self, to })
        }
    }
}

impl fmt::Display for SandboxState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SandboxState {
    type Err = StateError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SandboxState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| StateError::UnknownState(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_state() -> impl Strategy<Value = SandboxState> {
        (0..SandboxState::ALL.len()).prop_map(|i| SandboxState::ALL[i])
    }

    #[test]
    fn design_paths_are_legal() {
        let paths: &[&[SandboxState]] = &[
            &[
                Requested, Planning, Allocating, Locking, Leased, Running, Idle,
            ],
            &[
                Requested,
                Planning,
                Allocating,
                Provisioning,
                Locking,
                Leased,
                Running,
                Idle,
            ],
            &[Idle, ReuseChecking, Leased],
            &[Idle, ReuseChecking, Recycling],
            &[Idle, Hibernating, Provisioning],
            &[Idle, Sanitizing, Ready],
            &[Recycling, Sanitizing, Terminated],
            &[Running, Lost, Provisioning],
            &[Idle, Lost, Terminated],
        ];
        for path in paths {
            for w in path.windows(2) {
                w[0].transition(w[1]).unwrap();
            }
        }
    }

    #[test]
    fn terminated_is_final() {
        for s in SandboxState::ALL {
            assert!(!Terminated.can_transition_to(s));
        }
    }

    proptest! {
        #[test]
        fn name_round_trip(s in any_state()) {
            prop_assert_eq!(s.as_str().parse::<SandboxState>().unwrap(), s);
            let json = serde_json::to_string(&s).unwrap();
            prop_assert_eq!(serde_json::from_str::<SandboxState>(&json).unwrap(), s);
        }

        #[test]
        fn transition_agrees_with_table(a in any_state(), b in any_state()) {
            prop_assert_eq!(a.transition(b).is_ok(), a.successors().contains(&b));
        }

        /// From any state a random walk over legal moves can always reach
        /// Terminated (no state is a trap), and no state moves to itself.
        #[test]
        fn every_walk_can_end(start in any_state(), picks in proptest::collection::vec(0usize..16, 0..40)) {
            let mut s = start;
            for p in picks {
                let next = s.successors();
                if next.is_empty() { break; }
                let n = next[p % next.len()];
                prop_assert_ne!(n, s);
                s = s.transition(n).unwrap();
            }
            // Terminated is reachable from wherever the walk stopped.
            let mut seen = vec![s];
            let mut frontier = vec![s];
            while let Some(x) = frontier.pop() {
                for &y in x.successors() {
                    if !seen.contains(&y) { seen.push(y); frontier.push(y); }
                }
            }
            prop_assert!(s == Terminated || seen.contains(&Terminated));
        }
    }
}
